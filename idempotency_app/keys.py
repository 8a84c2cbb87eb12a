"""What identifies an idempotent request: its key, scope, operation and fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.http import HttpRequest
from django.http.request import RawPostDataException

from idempotency_app.conf import conf

MAX_KEY_LENGTH = 255
# Re-serialising JSON costs far more than hashing it; above this size the
# raw bytes are fingerprinted instead.
CANONICAL_JSON_MAX_BYTES = 16 * 1024


class InvalidKey(ValueError):
    """The header is present but unusable; the message says why."""


def parse_key(raw: str | None) -> str | None:
    """Return the key from a header value, ``None`` when the header is absent.

    Accepts a Structured-Field string (``"abc"``) and unquotes it.
    """
    if raw is None:
        return None
    value = raw.strip(" \t")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = _unquote_sf_string(value[1:-1])
    if not value.strip():
        raise InvalidKey("The Idempotency-Key header is empty.")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidKey(f"The Idempotency-Key header is longer than {MAX_KEY_LENGTH} characters.")
    if not all(" " <= ch <= "~" for ch in value):
        raise InvalidKey("The Idempotency-Key header may hold printable ASCII characters only.")
    return value


def _unquote_sf_string(inner: str) -> str:
    out = []
    chars = iter(inner)
    for ch in chars:
        if ch == "\\":
            escaped = next(chars, "")
            if escaped not in ('"', "\\"):
                raise InvalidKey(
                    'The quoted Idempotency-Key has an invalid escape; only \\" and \\\\ are allowed.'
                )
            out.append(escaped)
        elif ch == '"':
            raise InvalidKey('The quoted Idempotency-Key has an unescaped " inside it.')
        else:
            out.append(ch)
    return "".join(out)


def user_scope(request: Any) -> str | None:
    """The default scope: the authenticated principal.

    Anonymous requests get no scope, and the key is refused: two anonymous
    clients must never share a stored response. Projects with anonymous
    idempotent endpoints set ``SCOPE`` to a callable of their own.
    """
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return f"user:{user.pk}"


def _django_request(request: Any) -> HttpRequest:
    django_request: HttpRequest = getattr(request, "_request", request)
    return django_request


def operation(request: Any) -> str:
    """HTTP method plus the view's route pattern, not the concrete path."""
    match = getattr(_django_request(request), "resolver_match", None)
    route = match.route if match is not None and match.route else request.path_info
    return f"{request.method} {route}"[:255]


def request_body(request: Any) -> bytes:
    """The bytes that identify the body. Multipart uploads are described by
    their fields and each file's SHA-256, read in chunks: Django streams
    them to disk, and reading ``body`` would refuse any over
    ``DATA_UPLOAD_MAX_MEMORY_SIZE``."""
    django_request = _django_request(request)
    content_type = django_request.META.get("CONTENT_TYPE", "")
    if content_type.lower().startswith("multipart/") and hasattr(request, "POST"):
        return _multipart_description(request)
    try:
        return django_request.body
    except RawPostDataException:
        # The stream was read before idempotency ran (a custom
        # authentication class parsed it); DRF keeps the parsed data.
        return json.dumps(request.data, sort_keys=True, default=str).encode()


def _multipart_description(request: Any) -> bytes:
    fields = sorted((name, value) for name in request.POST for value in request.POST.getlist(name))
    files = []
    for name in sorted(request.FILES):
        for upload in request.FILES.getlist(name):
            digest = hashlib.sha256()
            for chunk in upload.chunks():
                digest.update(chunk)
            upload.seek(0)
            files.append([name, upload.name, upload.content_type, upload.size, digest.hexdigest()])
    return json.dumps([fields, files], default=str).encode()


def canonical_body(request: Any, body: bytes) -> bytes:
    """JSON re-serialised with sorted keys so that key order is not a change."""
    content_type = (request.content_type or "").split(";")[0].strip().lower()
    is_json = content_type == "application/json" or content_type.endswith("+json")
    if not is_json or not body or len(body) > CANONICAL_JSON_MAX_BYTES:
        return body
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return body
    try:
        return json.dumps(parsed, sort_keys=True, separators=(",", ":")).encode()
    except RecursionError:
        return body


def fingerprint(request: Any) -> str:
    """SHA-256 over what the request asks for, each part length-framed."""
    django_request = _django_request(request)
    match = getattr(django_request, "resolver_match", None)
    url_args = [list(match.args), sorted(match.kwargs.items())] if match else []
    parts: list[bytes] = [
        operation(request).encode(),  # the method and the route
        json.dumps(url_args, default=str).encode(),
        canonical_body(request, request_body(request)),
    ]
    for name in conf.FINGERPRINT_QUERY_PARAMS:
        parts.append(json.dumps(django_request.GET.getlist(name)).encode())
    for name in conf.FINGERPRINT_HEADERS:
        parts.append(django_request.headers.get(name, "").encode("utf-8", "surrogateescape"))
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def bounded_fingerprint(fingerprint: str) -> str:
    """A custom fingerprint longer than the column is hashed to fit it."""
    if len(fingerprint) <= 64:
        return fingerprint
    return hashlib.sha256(fingerprint.encode("utf-8", "surrogateescape")).hexdigest()


def bounded_scope(scope: str) -> str:
    """Scopes longer than the column, or holding NUL (which PostgreSQL text
    cannot store), are hashed: never truncated into a collision."""
    if len(scope) <= 255 and "\x00" not in scope:
        return scope
    return "sha256:" + hashlib.sha256(scope.encode("utf-8", "surrogateescape")).hexdigest()
