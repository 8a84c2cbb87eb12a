"""The bridge between DRF views and the core: shared by the decorator and the mixin.

It runs after DRF's ``initial()`` (authentication, permissions, throttling),
identifies the request, and hands the handler to ``core.run`` with a
``settle`` that decides what is stored.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse, HttpResponseBase
from django.middleware.locale import LocaleMiddleware
from django.utils import translation
from django.utils.http import http_date, parse_header_parameters
from django.utils.module_loading import import_string
from rest_framework.request import Request
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from idempotency_app import clock, core, keys, problems, signals, work
from idempotency_app.cache import guard
from idempotency_app.conf import SAFE_METHODS, conf, resolve_callable, to_seconds
from idempotency_app.exceptions import (
    IdempotencyError,
    IdempotencyKeyInvalid,
    IdempotencyKeyMissing,
    IdempotencyKeyReused,
    IdempotencyScopeMissing,
    IdempotencyStoreUnavailable,
    InvalidKey,
    OutcomeUnknown,
    ReplayNotAcceptable,
    RequestInProgress,
    RequestOutcomeUnknown,
    RequestRolledBack,
    StoreUnavailable,
)
from idempotency_app.store import Identity, StoredResponse

logger = logging.getLogger("idempotency_app")

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
# Outcomes a retry may change: released so that the retry runs again.
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
# Client errors fixed by correcting the request (a validation or parse error,
# an unsupported Content-Type): released so the corrected retry can run,
# and cached briefly so an uncorrected retry storm does not.
TRANSIENT_CLIENT_ERRORS = frozenset({400, 415})


@dataclass(frozen=True)
class Options:
    """Per-view overrides; None means "use the setting". Checked when the
    view is decorated or its class defined, so a mistake fails at import,
    not on a client's request."""

    ttl: float | None = None
    lease: float | None = None
    wait: float | None = None
    required: bool = False
    scope: str | Callable[[Any], str | None] | None = None
    fingerprint: str | Callable[[Any], str] | None = None
    methods: Iterable[str] | None = None

    def __post_init__(self) -> None:
        for name in ("ttl", "lease", "wait"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _duration(name, value))
        if self.methods is not None:
            object.__setattr__(self, "methods", _methods(self.methods))
        given = {"ttl": self.ttl, "lease": self.lease, "wait": self.wait}
        problems = core.policy_problems(
            self.ttl if self.ttl is not None else 1.0,
            self.lease if self.lease is not None else (self.wait or 0.0) + 1.0,
            self.wait or 0.0,
        )
        if problems:
            shown = ", ".join(f"{k}={v:g}" for k, v in given.items() if v is not None)
            raise ImproperlyConfigured(f"Idempotency options {shown}: " + " ".join(problems))

    def covers(self, method: str, default: Iterable[str]) -> bool:
        method = method.upper()
        return method not in SAFE_METHODS and method in (self.methods or default)


# Every view's options as declared, for the system check that judges them
# against the settings (which may change after import).
_declared: list[tuple[str, Options]] = []


def declare(name: str, options: Options) -> Options:
    if (options.ttl, options.lease, options.wait) != (None, None, None):
        _declared.append((name, options))
    return options


def declared_options() -> list[tuple[str, Options]]:
    return list(_declared)


def _duration(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise ImproperlyConfigured(
            f"The idempotency option {name}= must be a number of seconds or a timedelta, "
            f"not {value!r}."
        )
    return to_seconds(value)


def _methods(methods: Iterable[str]) -> frozenset[str]:
    if isinstance(methods, str) or not all(isinstance(m, str) and m for m in methods):
        raise ImproperlyConfigured(
            f"The idempotency option methods= must be a list of HTTP methods, not {methods!r}: "
            'write ["POST"], not "POST".'
        )
    upper = frozenset(m.upper() for m in methods)
    if upper & SAFE_METHODS:
        raise ImproperlyConfigured(
            f"The idempotency option methods= names {', '.join(sorted(upper & SAFE_METHODS))}: "
            "safe methods change nothing, so they never claim a key. Remove them."
        )
    return upper


def identify(request: Request, options: Options) -> Identity | None:
    """The request's identity, or None to run it without idempotency."""
    try:
        key = keys.parse_key(request.headers.get(conf.HEADER))
    except InvalidKey as exc:
        raise IdempotencyKeyInvalid(
            f"{exc} Send a new key: 1 to 255 printable ASCII characters, such as a UUID."
        ) from exc
    if key is None:
        if options.required:
            raise IdempotencyKeyMissing()
        return None
    scope = resolve_callable(options.scope or conf.SCOPE)(request)
    if scope is None or scope == "":
        raise IdempotencyScopeMissing()
    fingerprint = resolve_callable(options.fingerprint or conf.FINGERPRINT)(request)
    return Identity(
        keys.bounded(str(scope)),
        key,
        keys.operation(request),
        keys.identity_fingerprint(request, str(fingerprint)),
    )


def handle(
    view: APIView, request: Request, call: Callable[[], HttpResponseBase], options: Options
) -> HttpResponseBase:
    """Run ``call`` (the view's handler) under the idempotency lifecycle.

    The layer's own errors go to the project's exception handler, or are
    answered as problem details when ``ERROR_FORMAT`` is ``"problem"``."""
    try:
        return _handle(view, request, call, options)
    except IdempotencyError as exc:
        if conf.ERROR_FORMAT != "problem":
            raise
        return problems.respond(exc)


def _handle(
    view: APIView, request: Request, call: Callable[[], HttpResponseBase], options: Options
) -> HttpResponseBase:
    if not conf.ENABLED:
        return call()
    identity = identify(request, options)
    if identity is None:
        return call()
    if core.running(identity, conf.DATABASE_ALIAS) is not None:
        return call()  # a handler called by a handler of the same request: one execution
    policy = core.Policy.from_settings(options.ttl, options.lease, options.wait)
    accept = request.META.get("HTTP_ACCEPT", "")
    try:
        result = core.run(
            identity,
            lambda: _guarded_respond(identity, view, request, call),
            lambda response: _settle(identity, response, policy.ttl, accept),
            policy,
        )
    except StoreUnavailable as exc:
        raise IdempotencyStoreUnavailable() from exc
    except OutcomeUnknown as exc:
        raise RequestOutcomeUnknown() from exc
    if isinstance(result, core.Executed | core.RolledBack):
        _signal_executed(identity, result.value)
    if isinstance(result, core.Executed):
        response: HttpResponseBase = result.value
        if isinstance(response, _GuardNotAcceptable):
            raise response.refusal
        if result.stored is not None:
            response[EXPIRES_HEADER] = dict(result.stored.headers)[EXPIRES_HEADER]
        return response
    if isinstance(result, core.RolledBack):
        return _rolled_back(identity, result.value)
    if isinstance(result, core.Replay):
        return replay(result.response, request, view)
    if isinstance(result, core.InProgress):
        raise RequestInProgress(retry_after=result.retry_after)
    raise IdempotencyKeyReused()


def _rolled_back(identity: Identity, response: HttpResponseBase) -> HttpResponseBase:
    """The view's outcome did not commit. An error response says so already
    (DRF marks the transaction of every exception it handles for rollback
    under ATOMIC_REQUESTS); a success would be a lie."""
    if response.status_code >= 400:
        return response
    logger.error(
        "The view answered %s under idempotency key %r, but its transaction was rolled back, "
        "so nothing it did was kept: the client gets 500 request_rolled_back and may retry. "
        "Wrap a statement whose database error the view catches in its own "
        "transaction.atomic(), and do not call set_rollback(True) in a view that succeeds.",
        response.status_code,
        identity.key,
    )
    raise RequestRolledBack()


def _signal_executed(identity: Identity, response: HttpResponseBase) -> None:
    """Sent once the work is over (committed or not), so that a receiver's
    own writes are never part of it."""
    if getattr(response, "idempotency_guard_hit", False):
        signals.guard_hit.send(handle, identity=identity)
    else:
        signals.executed.send(handle, identity=identity, status=response.status_code)


def _guarded_respond(
    identity: Identity, view: APIView, request: Request, call: Callable[[], HttpResponseBase]
) -> HttpResponseBase:
    """Consulted only once the claim is won: the guard is written before a
    validation error's claim is released, so a winner always sees it. Only a
    claim that met the marker such an error leaves asks it: a fresh request
    never pays a cache round trip. The guard's own reads and writes are the
    library's, not the work's (it may be a database cache)."""
    held = core.running(identity, conf.DATABASE_ALIAS)
    cached = None
    if held is not None and held.guarded:
        with work.by_the_library():
            cached = guard.get(identity)
    if cached is not None:
        try:
            hit = replay(cached, request, view)
        except ReplayNotAcceptable as exc:
            return _GuardNotAcceptable(exc)
        hit.idempotency_guard_hit = True  # type: ignore[attr-defined]
        return hit
    return _respond(view, request, call)


class _GuardNotAcceptable(HttpResponse):
    """The guard's cached 400, which this request does not accept. Settled
    like a served 400 (the claim released, its marker kept, so the next
    retry meets the guard too), then the 406 is raised, outside the work."""

    idempotency_guard_hit = True

    def __init__(self, refusal: ReplayNotAcceptable) -> None:
        super().__init__(status=refusal.status_code)
        self.refusal = refusal


def _respond(
    view: APIView, request: Request, call: Callable[[], HttpResponseBase]
) -> HttpResponseBase:
    """The handler's response, rendered, with exceptions the view's handler
    understands (404, 403, validation errors) turned into responses, so that
    a deterministic 4xx raised in the view is stored like a returned one."""
    response: HttpResponseBase
    try:
        response = call()
    except Exception as exc:
        response = view.handle_exception(exc)
    # DRF annotates Response, but finalize_response takes any HttpResponseBase.
    response = view.finalize_response(request, response, *view.args, **view.kwargs)  # type: ignore[arg-type]
    render = getattr(response, "render", None)
    if callable(render):
        render()
    return response


def _settle(
    identity: Identity, response: HttpResponseBase, ttl: float, accept: str
) -> StoredResponse | core.Marked | None:
    """What to store, or None to release. A validation error is cached here,
    before the claim is released, so no duplicate slips in between.

    The stored headers include ``Idempotency-Expires``, the digest of the
    request's ``Accept`` (never replayed) and the ``Content-Language`` the
    response is about to get: the live response gets the first only once
    the completion is known to have been stored."""
    status = response.status_code
    if getattr(response, "idempotency_guard_hit", False):
        return core.MARKED  # release, and leave the cached window as it is
    extra = _language(response)
    if accept:
        extra += ((REQUEST_ACCEPT_DIGEST, _digest(accept)),)
    if status in TRANSIENT_CLIENT_ERRORS:
        with work.by_the_library():
            guard.set(identity, to_stored(response, extra))
        return core.MARKED
    if status >= 500 or status in RETRYABLE_STATUSES:
        return None
    expires = http_date((clock.now() + timedelta(seconds=ttl)).timestamp())
    return to_stored(response, ((EXPIRES_HEADER, expires), *extra))


def _digest(accept: str) -> str:
    """All a replay needs of the Accept it was produced for: whether a retry
    sends the same one. Its digest is small, whatever the client sent."""
    return hashlib.sha256(accept.encode("utf-8", "surrogatepass")).hexdigest()


def _language(response: HttpResponseBase) -> tuple[tuple[str, str], ...]:
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
    stored_type = next((v for n, v in stored.headers if n.lower() == "content-type"), "")
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
    response = HttpResponse(stored.body or b"", status=stored.status)
    del response["Content-Type"]
    for name, value in stored.headers:
        if name not in _NEVER_REPLAYED:
            response[name] = value
    if stored.body is None:
        response[BODY_OMITTED_HEADER] = "true"
        if "Content-Type" in response:
            del response["Content-Type"]
    response[REPLAYED_HEADER] = "true"
    return response


def _same_question(stored: StoredResponse, request: Request) -> bool:
    """Whether this request sends the Accept the stored response was
    produced for (its digest, or itself in a row stored before digests)."""
    accept: str = request.META.get("HTTP_ACCEPT", "")
    for name, value in stored.headers:
        if name == REQUEST_ACCEPT_DIGEST:
            return bool(accept) and value == _digest(accept)
        if name == REQUEST_ACCEPT:
            return value == accept
    return False


def accepts(request: Request, view: APIView, content_type: str) -> bool:
    """Whether this request takes a response of ``content_type``: the format
    its URL forces (``?format=json``, a ``.json`` suffix) when there is one,
    as DRF decides, else its Accept header (absent: anything)."""
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    forced = getattr(view, "format_kwarg", None) or request.query_params.get(
        api_settings.URL_FORMAT_OVERRIDE or ""
    )
    renderer = getattr(request, "accepted_renderer", None)
    if forced and renderer is not None:
        ranges = [renderer.media_type]
    else:
        ranges = [r for r in request.META.get("HTTP_ACCEPT", "").split(",") if r.strip()]
    if not ranges:
        return True
    for item in ranges:
        media_range, params = parse_header_parameters(item)
        try:
            if float(params.get("q", 1)) <= 0:
                continue
        except ValueError:
            pass
        want_main, _, want_sub = media_range.lower().partition("/")
        if want_main in ("*", main) and want_sub in ("*", sub):
            return True
    return False
