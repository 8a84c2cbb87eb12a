"""The bridge between DRF views and the lifecycle, shared by the decorator
and the mixin.

It runs after DRF's ``initial()`` (authentication, permissions, throttling),
identifies the request, and hands the handler to ``units.run`` with a
``settle`` that decides what is stored; the lifecycle's answers become
HTTP ones.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from datetime import timedelta

from django.http import HttpResponse, HttpResponseBase
from django.utils.http import http_date
from rest_framework.request import Request
from rest_framework.views import APIView

from idempotency_app import clock, signals
from idempotency_app.conf import conf, resolve_callable
from idempotency_app.exceptions import (
    IdempotencyError,
    IdempotencyKeyInvalid,
    IdempotencyKeyMissing,
    IdempotencyKeyReused,
    IdempotencyScopeMissing,
    IdempotencyStoreUnavailable,
    InvalidKey,
    KeyInProgress,
    KeyReused,
    OutcomeUnknown,
    ReplayNotAcceptable,
    RequestInProgress,
    RequestOutcomeUnknown,
    RequestRolledBack,
    StoreUnavailable,
    WorkRolledBack,
)
from idempotency_app.guard import guard
from idempotency_app.http import keys, problems
from idempotency_app.http.options import Options
from idempotency_app.http.replay import (
    EXPIRES_HEADER,
    REQUEST_ACCEPT_DIGEST,
    digest,
    language,
    replay,
    to_stored,
)
from idempotency_app.lifecycle import units, work
from idempotency_app.lifecycle.claims import Policy, Replay
from idempotency_app.store import Identity, StoredResponse

logger = logging.getLogger("idempotency_app")

# Outcomes a retry may change: released so that the retry runs again.
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
# Client errors fixed by correcting the request (a validation or parse error,
# an unsupported Content-Type): released so the corrected retry can run,
# and cached briefly so an uncorrected retry storm does not.
TRANSIENT_CLIENT_ERRORS = frozenset({400, 415})


def identify(request: Request, options: Options) -> Identity | None:
    """The request's identity, or None to run it without idempotency."""
    try:
        key = keys.parse_key(keys.http_request(request).headers.get(conf.HEADER))
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
    using = conf.DATABASE_ALIAS
    if units.running(identity, using) is not None:
        return call()  # a handler called by a handler of the same request: one execution
    policy = None
    if options.ttl is not None or options.lease is not None or options.wait is not None:
        # Judged against the settings on every request (a view may choose
        # its options per request), whatever then answers it.
        policy = Policy.from_settings(options.ttl, options.lease, options.wait)
    held = units.held_replay(identity, using)
    if held is not None:
        return replay(held.response, request, view)  # nothing else to decide
    if policy is None:
        policy = Policy.from_settings()
    accept = keys.http_request(request).META.get("HTTP_ACCEPT", "")
    try:
        result = units.run(
            identity,
            lambda: _guarded_respond(identity, view, request, call),
            lambda response: _settle(identity, response, policy.ttl, accept),
            policy,
        )
    except StoreUnavailable as exc:
        raise IdempotencyStoreUnavailable() from exc
    except OutcomeUnknown as exc:
        raise RequestOutcomeUnknown() from exc
    except KeyReused as exc:
        raise IdempotencyKeyReused() from exc
    except KeyInProgress as exc:
        raise RequestInProgress(retry_after=exc.retry_after) from exc
    except WorkRolledBack as exc:
        _signal_executed(identity, exc.value)
        return _rolled_back(identity, exc.value)
    if isinstance(result, Replay):
        return replay(result.response, request, view)
    _signal_executed(identity, result.value)
    response: HttpResponseBase = result.value
    if isinstance(response, _GuardNotAcceptable):
        raise response.refusal
    if result.stored is not None:
        response[EXPIRES_HEADER] = dict(result.stored.headers)[EXPIRES_HEADER]
    return response


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
    held = units.running(identity, conf.DATABASE_ALIAS)
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
) -> StoredResponse | units.Marked | None:
    """What to store, or None to release. A validation error is cached here,
    before the claim is released, so no duplicate slips in between.

    The stored headers include ``Idempotency-Expires``, the digest of the
    request's ``Accept`` (never replayed) and the ``Content-Language`` the
    response is about to get: the live response gets the first only once
    the completion is known to have been stored."""
    status = response.status_code
    if getattr(response, "idempotency_guard_hit", False):
        return units.MARKED  # release, and leave the cached window as it is
    extra = language(response)
    if accept:
        extra += ((REQUEST_ACCEPT_DIGEST, digest(accept)),)
    if status in TRANSIENT_CLIENT_ERRORS:
        with work.by_the_library():
            guard.set(identity, to_stored(response, extra))
        return units.MARKED
    if status >= 500 or status in RETRYABLE_STATUSES:
        return None
    expires = _http_date(math.floor((clock.now() + timedelta(seconds=ttl)).timestamp()))
    return to_stored(response, ((EXPIRES_HEADER, expires), *extra))


@functools.lru_cache(maxsize=8)
def _http_date(second: int) -> str:
    """``http_date`` (whole seconds, rounded down as it does), once per second:
    formatting a date costs more than the rest of deciding what to store."""
    return http_date(second)
