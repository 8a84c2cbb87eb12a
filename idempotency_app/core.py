"""The lifecycle: claim, execute, then complete or release. No HTTP here.

Atomic mode (the default, outside any transaction): the claim commits on its
own, then the work and the completion commit together in one transaction, so
an outcome is stored exactly when the work's database effects are, and a
worker whose claim was taken over rolls back instead of committing twice.

Nested mode (already inside a transaction, e.g. ``ATOMIC_REQUESTS``): the
claim cannot commit first, so claim, work and completion share a savepoint.
A concurrent duplicate then waits at its INSERT until the first commits, and
replays; a crash rolls everything back, leaving no row.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from django.db import Error, connections, transaction

from idempotency_app import clock, signals, store
from idempotency_app.conf import conf
from idempotency_app.store import Identity, StoredResponse

logger = logging.getLogger("idempotency_app")

T = TypeVar("T")

# How often a claim is retried when the record it met vanished or was taken
# over by someone else in between; each retry is a fresh INSERT.
MAX_CLAIM_ATTEMPTS = 5
POLL_INTERVAL = 0.05


class StoreUnavailable(Exception):
    """The database could not arbitrate the claim; nothing was executed."""


@dataclass(frozen=True)
class Claim:
    identity: Identity
    token: str
    using: str


@dataclass(frozen=True)
class Replay:
    response: StoredResponse


@dataclass(frozen=True)
class InProgress:
    """Another worker holds the key (or held it and won a takeover from us)."""

    retry_after: int = 1


@dataclass(frozen=True)
class Mismatch:
    """The key was used for a different request."""


@dataclass(frozen=True)
class Executed(Generic[T]):
    value: T
    stored: StoredResponse | None


Decision = Claim | Replay | InProgress | Mismatch


@dataclass(frozen=True)
class Policy:
    ttl: float
    lease: float
    wait: float
    using: str

    @classmethod
    def from_settings(
        cls, ttl: float | None = None, lease: float | None = None, wait: float | None = None
    ) -> Policy:
        return cls(
            ttl=conf.TTL if ttl is None else ttl,
            lease=conf.LEASE if lease is None else lease,
            wait=conf.WAIT_FOR_IN_FLIGHT if wait is None else wait,
            using=conf.DATABASE_ALIAS,
        )


def claim(identity: Identity, policy: Policy) -> Decision:
    """One INSERT arbitrated by the unique constraint decides who runs.

    A lock timeout or deadlock while claiming means another request holds the
    key's row inside a transaction: that is a 409, not an outage. Outside a
    transaction the failed statement left nothing behind, so it is retried
    like any duplicate in flight, within ``policy.wait``. Any other database
    error is ``StoreUnavailable``.
    """
    deadline = time.monotonic() + policy.wait
    while True:
        try:
            return _claim(identity, policy, deadline)
        except Error as exc:
            connection = connections[policy.using]
            if connection.in_atomic_block:
                # The failed statement spoiled the enclosing savepoint.
                transaction.set_rollback(True, using=policy.using)
            # Inside any transaction, a deadlock may have rolled back more
            # than our statement: retrying there would build on lost work.
            nested = connection.in_atomic_block or not connection.get_autocommit()
            if not _is_lock_conflict(exc):
                logger.error("Idempotency claim failed for %s: %s", identity.key, exc)
                raise StoreUnavailable(str(exc)) from exc
            logger.info("Lock conflict claiming idempotency key %s: %s", identity.key, exc)
            if nested or time.monotonic() >= deadline:
                signals.conflict.send(Claim, identity=identity)
                return InProgress()
            time.sleep(POLL_INTERVAL)


# MySQL lock wait timeout and deadlock; PostgreSQL deadlock, lock timeout and
# serialization failure.
_MYSQL_LOCK_ERRORS = {1205, 1213}
_POSTGRES_LOCK_STATES = {"40P01", "55P03", "40001"}


def _is_lock_conflict(exc: Exception) -> bool:
    cause = exc.__cause__ or exc
    if getattr(cause, "sqlstate", None) in _POSTGRES_LOCK_STATES:
        return True
    if getattr(cause, "pgcode", None) in _POSTGRES_LOCK_STATES:
        return True
    args = getattr(cause, "args", ())
    if args and args[0] in _MYSQL_LOCK_ERRORS:
        return True
    return "database is locked" in str(exc)


def _claim(identity: Identity, policy: Policy, deadline: float) -> Decision:
    for _ in range(MAX_CLAIM_ATTEMPTS):
        token = secrets.token_hex(16)
        now = clock.now()
        found = store.insert_or_fetch(identity, token, now, policy.ttl, policy.lease, policy.using)
        while isinstance(found, store.Existing):
            # An in-progress claim is judged by its lease alone: a per-view TTL
            # shorter than the lease (or a renewed lease) must not let a
            # duplicate take over work that is still running.
            if found.expired and (found.response is not None or found.lapsed):
                if store.take_over(
                    identity, found.token, token, now, policy.ttl, policy.lease, policy.using
                ):
                    return Claim(identity, token, policy.using)
                break
            if not found.matches(identity):
                signals.mismatch.send(Claim, identity=identity)
                return Mismatch()
            if found.response is not None:
                signals.replayed.send(Claim, identity=identity)
                return Replay(found.response)
            if found.lapsed:
                if store.take_over(
                    identity, found.token, token, now, policy.ttl, policy.lease, policy.using
                ):
                    logger.warning("Took over the lapsed claim on idempotency key %s", identity.key)
                    signals.takeover.send(Claim, identity=identity)
                    return Claim(identity, token, policy.using)
                break
            if time.monotonic() >= deadline or connections[policy.using].in_atomic_block:
                signals.conflict.send(Claim, identity=identity)
                return InProgress()
            time.sleep(POLL_INTERVAL)
            now = clock.now()
            found = store.fetch(identity, now, policy.using)
        if found is store.CLAIMED:
            return Claim(identity, token, policy.using)
    signals.conflict.send(Claim, identity=identity)
    return InProgress()


def run(
    identity: Identity,
    work: Callable[[], T],
    settle: Callable[[T], StoredResponse | None],
    policy: Policy,
) -> Executed[T] | Replay | InProgress | Mismatch:
    """Run ``work`` once for ``identity``.

    ``settle`` turns the work's value into what to store, or None to release
    the claim (and roll the work back) so that a retry runs again. An
    exception from ``work`` releases the claim and propagates.
    """
    if connections[policy.using].in_atomic_block:
        return _run_nested(identity, work, settle, policy)
    decision = claim(identity, policy)
    if not isinstance(decision, Claim):
        return decision
    return execute(decision, work, settle, policy)


def execute(
    held: Claim,
    work: Callable[[], T],
    settle: Callable[[T], StoredResponse | None],
    policy: Policy,
) -> Executed[T] | InProgress:
    """Atomic mode: the work and the completion commit together or not at all."""
    try:
        with transaction.atomic(using=held.using):
            value = work()
            response, lost = _finish(held, value, settle, policy)
    except BaseException:
        release_quietly(held)
        raise
    if lost:
        return InProgress()
    if response is None:
        release_quietly(held)
    return Executed(value, response)


def _run_nested(
    identity: Identity,
    work: Callable[[], T],
    settle: Callable[[T], StoredResponse | None],
    policy: Policy,
) -> Executed[T] | Replay | InProgress | Mismatch:
    """Claim, work and completion in one savepoint: a release is its rollback."""
    with transaction.atomic(using=policy.using):
        decision = claim(identity, policy)
        if not isinstance(decision, Claim):
            return decision
        value = work()
        response, lost = _finish(decision, value, settle, policy)
    return InProgress() if lost else Executed(value, response)


def _finish(
    held: Claim, value: T, settle: Callable[[T], StoredResponse | None], policy: Policy
) -> tuple[StoredResponse | None, bool]:
    """Inside the work's transaction: complete the claim, or mark the
    transaction for rollback. Returns what was stored and whether the claim
    was lost to a takeover.

    Work that marked its own transaction for rollback is released: DRF does
    that for every exception it handles when ``ATOMIC_REQUESTS`` is on.
    """
    response = settle(value)
    if response is not None and connections[held.using].needs_rollback:
        response = None
    if response is None:
        transaction.set_rollback(True, using=held.using)
        return None, False
    if store.complete(held.identity, held.token, response, clock.now(), policy.ttl, held.using):
        return response, False
    transaction.set_rollback(True, using=held.using)
    logger.warning(
        "Rolled back work on idempotency key %s: its claim was taken over", held.identity.key
    )
    signals.conflict.send(Claim, identity=held.identity)
    return None, True


def release_quietly(held: Claim) -> None:
    """Release after a failure; if the database is the failure, the lease
    expiring is the fallback, and the original error is what matters."""
    try:
        store.release(held.identity, held.token, held.using)
    except Error:
        logger.exception(
            "Could not release idempotency key %s; it frees when its lease ends", held.identity.key
        )
