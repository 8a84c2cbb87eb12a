"""Idempotency for work that is not an HTTP view: tasks, webhooks, consumers.

Queues, brokers and webhook senders deliver at least once. The same claim,
lease, fencing and replay as the DRF integration make each delivery of one
(scope, key) run its work once; every copy gets the same result.

- ``@idempotent_task(key=..., scope=...)`` wraps a task or handler function.
- ``with once(scope, key, operation) as run:`` guards a block of code.
- ``claim`` / ``complete`` / ``release`` / ``renew`` drive it by hand;
  ``lookup`` / ``lookup_many`` read what is stored; ``complete_many``
  completes a batch in one transaction.
- ``derive_key`` makes a stable key for a downstream API from ours.

A result is stored as JSON in ``response_body`` with ``response_status``
200 and a ``Content-Type: application/json`` header. Only what survives a
JSON round trip unchanged is accepted (tuples come back as lists); anything
else raises ``TypeError`` and the work is rolled back and its claim released.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ParamSpec

from django.db import connections, transaction

from idempotency_app import clock, core, keys, signals, store
from idempotency_app.conf import conf
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity, StoredResponse

__all__ = [
    "ClaimLost",
    "Done",
    "Entry",
    "Held",
    "KeyInProgress",
    "KeyReused",
    "Run",
    "StoreUnavailable",
    "claim",
    "complete",
    "complete_many",
    "derive_key",
    "idempotent_task",
    "lookup",
    "lookup_many",
    "once",
    "release",
    "renew",
]

P = ParamSpec("P")

RESULT_STATUS = 200
RESULT_HEADERS = (("Content-Type", "application/json"),)
# One IN (...) list per this many keys: well under every backend's limit
# on query parameters.
LOOKUP_BATCH = 1000

StoreUnavailable = core.StoreUnavailable


class KeyInProgress(Exception):
    """Another worker holds the key: retry later (a queue's retry fits)."""

    def __init__(self, key: str, retry_after: int = 1) -> None:
        super().__init__(
            f"Idempotency key {key!r} is being processed by another worker; "
            f"retry in {retry_after}s or more to get its result."
        )
        self.key = key
        self.retry_after = retry_after


class ClaimLost(KeyInProgress):
    """Our lease ran out and another worker took the key over; our work was
    rolled back, and a retry gets the new owner's result."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.args = (
            f"The claim on idempotency key {key!r} was taken over after its lease "
            "ran out; this worker's work was rolled back. Raise the lease above "
            "the slowest run, or call renew() while working.",
        )


class KeyReused(Exception):
    """The key was already used for another operation or fingerprint."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"Idempotency key {key!r} was already used for a different operation "
            "or fingerprint; use a new key for different work."
        )
        self.key = key


# -- identity and results ----------------------------------------------------


def make_identity(scope: str, key: str | int, operation: str, fingerprint: Any = None) -> Identity:
    """Check the parts before anything touches the database.

    ``fingerprint`` is any JSON value describing what the work is asked to
    do; it is hashed, never stored. None means "no fingerprint": later calls
    must also pass None, or they are a different request (KeyReused).
    """
    if not isinstance(scope, str):
        raise TypeError(f"An idempotency scope must be a string, not {scope!r}.")
    if not scope:
        raise ValueError("An idempotency scope must not be empty.")
    if isinstance(key, int) and not isinstance(key, bool):
        key = str(key)
    if not isinstance(key, str):
        raise TypeError(f"An idempotency key must be a string or an int, not {key!r}.")
    if not key:
        raise ValueError("An idempotency key must not be empty.")
    if len(key) > keys.MAX_KEY_LENGTH:
        raise ValueError(
            f"An idempotency key may be {keys.MAX_KEY_LENGTH} characters at most; "
            "hash longer ones first."
        )
    if "\x00" in key:
        raise ValueError("An idempotency key must not contain NUL; PostgreSQL cannot store it.")
    if not isinstance(operation, str) or len(operation) > 255 or "\x00" in operation:
        raise ValueError("An operation must be a string of 255 characters at most, without NUL.")
    digest = (
        ""
        if fingerprint is None
        else hashlib.sha256(encode(fingerprint, "fingerprint")).hexdigest()
    )
    return Identity(keys.bounded_scope(scope), key, operation, digest)


def encode(value: Any, name: str = "result") -> bytes:
    """Compact JSON, refusing what would not come back equal."""
    _check_json(value, name)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def _check_json(value: Any, path: str) -> None:
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{path} is {value!r}: JSON has no NaN or infinity.")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json(item, f"{path}[{index}]")
        return
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{path} has the key {name!r}: JSON object keys must be strings.")
            _check_json(item, f"{path}[{name!r}]")
        return
    raise TypeError(
        f"{path} is a {type(value).__name__}, which JSON cannot hold; convert it "
        "(str() for Decimal, UUID or datetime, a list for a set, an id for a model)."
    )


def decode(response: StoredResponse) -> Any:
    if response.body is None or dict(response.headers).get("Content-Type") != "application/json":
        raise ValueError("This record was not stored by the service API: it holds no JSON result.")
    return json.loads(response.body)


def _stored(body: bytes) -> StoredResponse:
    if len(body) > conf.MAX_BODY_BYTES:
        raise ValueError(
            f"The result is {len(body)} bytes of JSON, above MAX_BODY_BYTES "
            f"({conf.MAX_BODY_BYTES}); return a reference such as an id instead."
        )
    return StoredResponse(RESULT_STATUS, RESULT_HEADERS, body)


def derive_key(scope: str, key: str, label: str) -> str:
    """A stable key for a call to a downstream API made while handling ``key``.

    The same (scope, key, label) always gives the same 64 hex characters, so
    a retried job sends its payment provider the key it sent the first time.
    Never change this function: keys already sent depend on it.
    """
    digest = hashlib.sha256()
    for part in (scope, key, label):
        raw = part.encode("utf-8", "surrogateescape")
        digest.update(len(raw).to_bytes(8, "big"))
        digest.update(raw)
    return digest.hexdigest()


# -- by hand -----------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """A claim this worker owns: ``complete`` it or ``release`` it."""

    identity: Identity
    token: str
    policy: core.Policy

    @property
    def key(self) -> str:
        return self.identity.key

    def derive_key(self, label: str) -> str:
        return derive_key(self.identity.scope, self.identity.key, label)

    def core_claim(self) -> core.Claim:
        return core.Claim(self.identity, self.token, self.policy.using)


@dataclass(frozen=True)
class Done:
    """The key was completed before: its stored result."""

    result: Any


def claim(
    scope: str,
    key: str | int,
    operation: str,
    fingerprint: Any = None,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
) -> Held | Done:
    """Claim ``key`` for this worker, or return the result stored for it.

    Raises ``KeyInProgress`` while another worker holds it (after waiting up
    to ``wait`` seconds for it to finish), ``KeyReused`` when it was used
    for another operation or fingerprint, ``StoreUnavailable`` when the
    database cannot answer. The claim commits at once unless the caller is
    inside a transaction.
    """
    identity = make_identity(scope, key, operation, fingerprint)
    policy = core.Policy.from_settings(ttl, lease, wait)
    return _decide(identity, policy)


def _decide(identity: Identity, policy: core.Policy) -> Held | Done:
    decision = core.claim(identity, policy)
    if isinstance(decision, core.Claim):
        return Held(identity, decision.token, policy)
    if isinstance(decision, core.Replay):
        return Done(decode(decision.response))
    if isinstance(decision, core.InProgress):
        raise KeyInProgress(identity.key, decision.retry_after)
    raise KeyReused(identity.key)


def complete(held: Held, result: Any = None) -> Any:
    """Store ``result`` for the key. Call it inside the transaction that did
    the work, so both commit together: on ``ClaimLost`` that transaction
    rolls back. Raises ``TypeError`` for a result JSON cannot hold.

    Returns the result as every duplicate will read it back (tuples become
    lists), so the first caller can answer exactly as the others do.
    """
    return complete_many([(held, result)])[0]


def complete_many(items: Iterable[tuple[Held, Any]]) -> list[Any]:
    """Complete several claims together, all or none.

    Every result is encoded before anything is written. One UPDATE per
    claim, all in one transaction: if any claim was taken over, none is
    completed and ``ClaimLost`` names the first lost key (inside the caller's
    transaction, the batch's work rolls back with it). Returns the results
    as duplicates will read them back.
    """
    pending = [(held, _stored(encode(result))) for held, result in items]
    if not pending:
        return []
    using = pending[0][0].policy.using
    if any(held.policy.using != using for held, _ in pending):
        raise ValueError("complete_many() needs claims on one database.")
    now = clock.now()
    with transaction.atomic(using=using):
        for held, response in pending:
            if not store.complete(held.identity, held.token, response, now, held.policy.ttl, using):
                signals.conflict.send(core.Claim, identity=held.identity)
                raise ClaimLost(held.key)
    for held, _ in pending:
        signals.executed.send(core.Claim, identity=held.identity, status=RESULT_STATUS)
    return [decode(response) for _, response in pending]


def release(held: Held) -> bool:
    """Give up an unfinished claim so that a retry runs again.

    A completed result is never deleted, so a release in an ``except`` that
    also covers code after ``complete`` cannot cause a second run. False
    when the claim was completed, released or taken over.
    """
    return store.release(held.identity, held.token, held.policy.using)


def renew(held: Held, lease: float | None = None) -> bool:
    """Extend the lease of a long run; False if the claim was taken over."""
    seconds = held.policy.lease if lease is None else lease
    return store.renew(held.identity, held.token, clock.now(), seconds, held.policy.using)


# -- reading -----------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A live record as one query saw it. Expired records are not entries."""

    key: str
    operation: str
    status: str
    expires_at: datetime
    locked_until: datetime | None
    body: bytes | None = field(repr=False)
    headers: str = field(repr=False)

    @property
    def completed(self) -> bool:
        return self.status == store.COMPLETED

    @property
    def result(self) -> Any:
        """The stored result; None while the work is in progress."""
        if not self.completed:
            return None
        return decode(StoredResponse(RESULT_STATUS, store.parse_headers(self.headers), self.body))


def lookup(scope: str, key: str | int) -> Entry | None:
    key = str(key)
    return lookup_many(scope, [key]).get(key)


def lookup_many(scope: str, keys_: Iterable[str | int]) -> dict[str, Entry]:
    """The live records for ``keys_`` in ``scope``, by key, in one query
    (one per 1000 keys). A key with no entry has never run, or expired, or
    was released: claim it. Reading is advice; the claim stays the arbiter.
    """
    wanted = sorted({str(k) for k in keys_})
    found: dict[str, Entry] = {}
    records = IdempotencyRecord.objects.using(conf.DATABASE_ALIAS)
    now = clock.now()
    for start in range(0, len(wanted), LOOKUP_BATCH):
        rows = records.filter(
            scope=keys.bounded_scope(scope),
            key__in=wanted[start : start + LOOKUP_BATCH],
            expires_at__gt=now,
        ).values_list(
            "key",
            "operation",
            "status",
            "expires_at",
            "locked_until",
            "response_body",
            "response_headers",
        )
        for key, operation, status, expires_at, locked_until, body, headers in rows:
            raw = None if body is None else bytes(body)
            found[key] = Entry(key, operation, status, expires_at, locked_until, raw, headers)
    return found


# -- a block of code ---------------------------------------------------------


class Run:
    """What ``once()`` hands the block: run the work only if
    ``should_execute``, and set ``result``; on a duplicate, ``replayed`` is
    True and ``result`` holds the stored result."""

    def __init__(self, identity: Identity, held: Held | None, result: Any = None) -> None:
        self.identity = identity
        self.held = held
        self._result = result

    @property
    def should_execute(self) -> bool:
        return self.held is not None

    @property
    def replayed(self) -> bool:
        return self.held is None

    @property
    def result(self) -> Any:
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self.held is None:
            raise RuntimeError(
                "This run was replayed: its result is the stored one. Check "
                "run.should_execute before doing the work."
            )
        self._result = value

    def derive_key(self, label: str) -> str:
        return derive_key(self.identity.scope, self.identity.key, label)

    def renew(self, lease: float | None = None) -> bool:
        if self.held is None:
            raise RuntimeError("Only a run that executes holds a lease.")
        return renew(self.held, lease)


@contextlib.contextmanager
def once(
    scope: str,
    key: str | int,
    operation: str,
    fingerprint: Any = None,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
) -> Iterator[Run]:
    """Run a block once per (scope, key)::

        with once("provider:acme", event["id"], "payout") as run:
            if run.should_execute:
                run.result = pay(event)
        return run.result

    The block runs in a transaction that also stores ``run.result``: both
    commit, or neither (an exception releases the claim and propagates).
    After the block, ``run.result`` is the stored form for every copy.
    A duplicate of a completed key skips the work and reads the stored
    result; of a key in progress, raises ``KeyInProgress`` before the block.
    """
    identity = make_identity(scope, key, operation, fingerprint)
    policy = core.Policy.from_settings(ttl, lease, wait)
    if not conf.ENABLED:
        yield Run(identity, Held(identity, "", policy))
        return
    if connections[policy.using].in_atomic_block:
        # Nested: claim, work and completion share a savepoint; a failure
        # rolls the claim back with the rest.
        with transaction.atomic(using=policy.using):
            decision = _decide(identity, policy)
            if isinstance(decision, Done):
                yield Run(identity, None, decision.result)
                return
            run = Run(identity, decision)
            yield run
            run._result = complete(decision, run.result)
        return
    decision = _decide(identity, policy)
    if isinstance(decision, Done):
        yield Run(identity, None, decision.result)
        return
    run = Run(identity, decision)
    try:
        with transaction.atomic(using=policy.using):
            yield run
            run._result = complete(decision, run.result)
    except BaseException:
        core.release_quietly(decision.core_claim())
        raise


# -- a function --------------------------------------------------------------


def idempotent_task(
    *,
    key: Callable[..., str | int],
    scope: str | Callable[..., str],
    operation: str | None = None,
    fingerprint: Callable[..., Any] | None = None,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """Run the decorated function once per key; duplicates get its stored result.

    ``key``, ``scope`` (when callable) and ``fingerprint`` receive the
    function's own arguments: ``key=lambda event: event["id"]``. The
    operation defaults to the function's dotted name. The function's work and
    its stored result commit together. Every caller, the first included,
    gets the result as JSON decodes it.
    """

    def decorate(func: Callable[P, Any]) -> Callable[P, Any]:
        name = operation or f"{func.__module__}.{func.__qualname__}"[-255:]

        def identify(*args: Any, **kwargs: Any) -> Identity:
            where = scope(*args, **kwargs) if callable(scope) else scope
            facts = None if fingerprint is None else fingerprint(*args, **kwargs)
            return make_identity(where, key(*args, **kwargs), name, facts)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            identity = identify(*args, **kwargs)
            if not conf.ENABLED:
                return func(*args, **kwargs)
            policy = core.Policy.from_settings(ttl, lease, wait)
            outcome = core.run(identity, lambda: encode(func(*args, **kwargs)), _stored, policy)
            if isinstance(outcome, core.Executed):
                signals.executed.send(core.Claim, identity=identity, status=RESULT_STATUS)
                return json.loads(outcome.value)
            if isinstance(outcome, core.Replay):
                return decode(outcome.response)
            if isinstance(outcome, core.InProgress):
                raise KeyInProgress(identity.key, outcome.retry_after)
            raise KeyReused(identity.key)

        wrapper.identify = identify  # type: ignore[attr-defined]
        return wrapper

    return decorate
