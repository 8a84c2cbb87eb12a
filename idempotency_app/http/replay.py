"""What is kept of a response, and how it is replayed: the stored bytes as
they were sent, with the headers that let a client read them."""

from __future__ import annotations

import contextlib
import functools
import hashlib

from django.conf import settings
from django.http import HttpResponse, HttpResponseBase
from django.middleware.locale import LocaleMiddleware
from django.utils import translation
from django.utils.http import parse_header_parameters
from django.utils.module_loading import import_string
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.utils.mediatypes import media_type_matches
from rest_framework.views import APIView

from idempotency_app.conf import conf
from idempotency_app.exceptions import ReplayNotAcceptable
from idempotency_app.http.keys import http_request
from idempotency_app.store import StoredResponse

REPLAYED_HEADER = "Idempotent-Replayed"
BODY_OMITTED_HEADER = "Idempotent-Body-Omitted"
# On every stored response and its replays: until when a retry replays it.
EXPIRES_HEADER = "Idempotency-Expires"
# Kept with a stored response, never sent: the SHA-256 of the Accept it was
# produced for. A retry asking the same question gets the same answer,
# whatever it is.
REQUEST_ACCEPT_DIGEST = "Idempotency-Request-Accept-SHA256"
# The Accept itself, as rows stored before the digest hold it: read, never
# written.
REQUEST_ACCEPT = "Idempotency-Request-Accept"
_NEVER_REPLAYED = frozenset({REQUEST_ACCEPT_DIGEST, REQUEST_ACCEPT})


def digest(accept: str) -> str:
    """All a replay needs of the Accept it was produced for: whether a retry
    sends the same one. Its digest is small, whatever the client sent. Every
    fresh request and every replay asks, and clients send a few values: the
    digest of one of ordinary length is kept."""
    if len(accept) <= MAX_KEPT_ACCEPT:
        return _kept_digest(accept)
    return _digest(accept)


def _digest(accept: str) -> str:
    return hashlib.sha256(accept.encode("utf-8", "surrogatepass")).hexdigest()


# The longest Accept whose digest is kept; 64 are kept at most (64 KB).
MAX_KEPT_ACCEPT = 1024
_kept_digest = functools.lru_cache(maxsize=64)(_digest)


def language(response: HttpResponseBase) -> tuple[tuple[str, str], ...]:
    """The ``Content-Language`` that ``LocaleMiddleware`` gives the response
    after the view, so after it is stored: stored with it, so that a replay
    names the language of its body, not the retry's (the middleware never
    overwrites one that is there). None without the middleware, as the
    response itself has none."""
    if "Content-Language" in response or not _adds_language(tuple(settings.MIDDLEWARE)):
        return ()
    language = translation.get_language()
    return (("Content-Language", language),) if language else ()


@functools.lru_cache(maxsize=4)
def _adds_language(middleware: tuple[str, ...]) -> bool:
    for path in middleware:
        with contextlib.suppress(ImportError):
            found = import_string(path)
            if isinstance(found, type) and issubclass(found, LocaleMiddleware):
                return True
    return False


def to_stored(
    response: HttpResponseBase, extra_headers: tuple[tuple[str, str], ...] = ()
) -> StoredResponse:
    allowed = conf.STORED_HEADERS
    headers = (
        *((name, value) for name, value in response.items() if name.lower() in allowed),
        *extra_headers,
    )
    body: bytes | None = None
    if not response.streaming:
        content: bytes = response.content  # type: ignore[attr-defined]
        if len(content) <= conf.MAX_BODY_BYTES:
            body = content
    return StoredResponse(response.status_code, headers, body)


def replay(stored: StoredResponse, request: Request, view: APIView) -> HttpResponse:
    """The stored bytes as they were sent: nothing is rendered again, so a
    request that does not accept the stored media type gets 406 (and the
    work does not run again)."""
    stored_type = next((v for n, v in stored.headers if n.lower() == "content-type"), None)
    if (
        stored_type
        and not _same_question(stored, request)
        and not accepts(request, view, stored_type)
    ):
        media_type = stored_type.split(";", 1)[0].strip()
        raise ReplayNotAcceptable(
            f"The response stored for this Idempotency-Key is {media_type}, which this "
            "request does not accept. It was not run again: retry with an Accept header "
            f"(or format) that allows {media_type}."
        )
    # Set one by one, as stored (a name repeated in another case: the last
    # one stands), then the replay's own.
    headers = [(name, value) for name, value in stored.headers if name not in _NEVER_REPLAYED]
    if stored.body is None:
        headers.append((BODY_OMITTED_HEADER, "true"))
    headers.append((REPLAYED_HEADER, "true"))
    response = HttpResponse(stored.body or b"", status=stored.status, headers=headers)
    if stored_type is None or stored.body is None:
        del response["Content-Type"]  # Django's default, or a type for no body
    return response


def _same_question(stored: StoredResponse, request: Request) -> bool:
    """Whether this request sends the Accept the stored response was
    produced for (its digest, or itself in a row stored before digests)."""
    accept: str = http_request(request).META.get("HTTP_ACCEPT", "")
    for name, value in stored.headers:
        if name == REQUEST_ACCEPT_DIGEST:
            return bool(accept) and value == digest(accept)
        if name == REQUEST_ACCEPT:
            return value == accept
    return False


def accepts(request: Request, view: APIView, content_type: str) -> bool:
    """Whether this request takes a response of ``content_type``: the format
    its URL forces (``?format=json``, a ``.json`` suffix) when there is one,
    as DRF decides, else its Accept header (absent: anything)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    forced = getattr(view, "format_kwarg", None)
    if not forced:
        # Asked with ``in`` first: a QueryDict's get() of a missing name
        # raises and catches an exception inside, most of what this costs.
        override, query = api_settings.URL_FORMAT_OVERRIDE, request.query_params
        forced = query.get(override) if override is not None and override in query else None
    renderer = getattr(request, "accepted_renderer", None)
    if forced and renderer is not None:
        ranges = [renderer.media_type]
    else:
        accept = http_request(request).META.get("HTTP_ACCEPT", "")
        ranges = [r for r in accept.split(",") if r.strip()]
    if not ranges:
        return True
    for item in ranges:
        media_range, params = parse_header_parameters(item)
        try:
            if float(params.get("q", 1)) <= 0:
                continue
        except ValueError:
            pass
        if media_type_matches(media_type, media_range.lower()):
            return True
    return False
