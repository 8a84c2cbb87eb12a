"""The bridge between DRF views and the core: shared by the decorator and the mixin.

It runs after DRF's ``initial()`` (authentication, permissions, throttling),
identifies the request, and hands the handler to ``core.run`` with a
``settle`` that decides what is stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.http import HttpResponse, HttpResponseBase
from django.utils.http import http_date
from rest_framework.request import Request
from rest_framework.views import APIView

from idempotency_app import clock, core, keys, signals
from idempotency_app.cache import guard
from idempotency_app.conf import conf, resolve_callable
from idempotency_app.exceptions import (
    IdempotencyKeyInvalid,
    IdempotencyKeyMissing,
    IdempotencyKeyReused,
    IdempotencyScopeMissing,
    IdempotencyStoreUnavailable,
    RequestInProgress,
)
from idempotency_app.store import Identity, StoredResponse

REPLAYED_HEADER = "Idempotent-Replayed"
BODY_OMITTED_HEADER = "Idempotent-Body-Omitted"
# On every stored response and its replays: until when a retry replays it.
EXPIRES_HEADER = "Idempotency-Expires"
# Outcomes a retry may change: released so that the retry runs again.
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
# Client errors fixed by correcting the request (a validation or parse error,
# an unsupported Content-Type): released so the corrected retry can run,
# and cached briefly so an uncorrected retry storm does not.
TRANSIENT_CLIENT_ERRORS = frozenset({400, 415})


@dataclass(frozen=True)
class Options:
    """Per-view overrides; None means "use the setting"."""

    ttl: float | None = None
    lease: float | None = None
    wait: float | None = None
    required: bool = False
    scope: str | Callable[[Any], str | None] | None = None
    fingerprint: str | Callable[[Any], str] | None = None
    methods: Iterable[str] | None = None

    def covers(self, method: str, default: Iterable[str]) -> bool:
        return method.upper() in {m.upper() for m in (self.methods or default)}


def identify(request: Request, options: Options) -> Identity | None:
    """The request's identity, or None to run it without idempotency."""
    try:
        key = keys.parse_key(request.headers.get(conf.HEADER))
    except keys.InvalidKey as exc:
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
        keys.bounded_scope(str(scope)),
        key,
        keys.operation(request),
        keys.bounded_fingerprint(str(fingerprint)),
    )


def handle(
    view: APIView, request: Request, call: Callable[[], HttpResponseBase], options: Options
) -> HttpResponseBase:
    """Run ``call`` (the view's handler) under the idempotency lifecycle."""
    if not conf.ENABLED:
        return call()
    identity = identify(request, options)
    if identity is None:
        return call()
    policy = core.Policy.from_settings(options.ttl, options.lease, options.wait)
    try:
        result = core.run(
            identity,
            lambda: _guarded_respond(identity, view, request, call),
            lambda response: _settle(identity, response, policy.ttl),
            policy,
        )
    except core.StoreUnavailable as exc:
        raise IdempotencyStoreUnavailable() from exc
    if isinstance(result, core.Executed):
        response: HttpResponseBase = result.value
        if result.stored is not None:
            response[EXPIRES_HEADER] = dict(result.stored.headers)[EXPIRES_HEADER]
        return response
    if isinstance(result, core.Replay):
        return replay(result.response)
    if isinstance(result, core.InProgress):
        raise RequestInProgress(retry_after=result.retry_after)
    raise IdempotencyKeyReused()


def _guarded_respond(
    identity: Identity, view: APIView, request: Request, call: Callable[[], HttpResponseBase]
) -> HttpResponseBase:
    """Consulted only once the claim is won: the guard is written before a
    validation error's claim is released, so a winner always sees it."""
    cached = guard.get(identity)
    if cached is not None:
        signals.guard_hit.send(handle, identity=identity)
        hit = replay(cached)
        hit.idempotency_guard_hit = True  # type: ignore[attr-defined]
        return hit
    response = _respond(view, request, call)
    signals.executed.send(handle, identity=identity, status=response.status_code)
    return response


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


def _settle(identity: Identity, response: HttpResponseBase, ttl: float) -> StoredResponse | None:
    """What to store, or None to release. A validation error is cached here,
    before the claim is released, so no duplicate slips in between.

    The stored headers include ``Idempotency-Expires``; the live response
    gets it only once the completion is known to have been stored."""
    status = response.status_code
    if getattr(response, "idempotency_guard_hit", False):
        return None  # release, and leave the cached window as it is
    if status in TRANSIENT_CLIENT_ERRORS:
        guard.set(identity, to_stored(response))
        return None
    if status >= 500 or status in RETRYABLE_STATUSES:
        return None
    expires = http_date((clock.now() + timedelta(seconds=ttl)).timestamp())
    return to_stored(response, ((EXPIRES_HEADER, expires),))


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


def replay(stored: StoredResponse) -> HttpResponse:
    """The stored bytes as they were sent: nothing is rendered again."""
    response = HttpResponse(stored.body or b"", status=stored.status)
    del response["Content-Type"]
    for name, value in stored.headers:
        response[name] = value
    if stored.body is None:
        response[BODY_OMITTED_HEADER] = "true"
        if "Content-Type" in response:
            del response["Content-Type"]
    response[REPLAYED_HEADER] = "true"
    return response
