"""The lifecycle: claim, execute, then complete or release. No HTTP here.

Atomic mode (the default, outside any transaction): the claim commits on its
own, then the work and the completion commit together in one transaction, so
an outcome is stored exactly when the work's database effects are, and a
worker whose claim was taken over rolls back instead of committing twice.

Nested mode (already inside a transaction, e.g. ``ATOMIC_REQUESTS``): the
claim cannot commit first, so claim, work and completion share a savepoint.
A concurrent duplicate then waits at its INSERT until the first commits, and
replays; a crash rolls everything back, leaving no row.

Either way one rule holds: an outcome is stored, and reported as such, only
if the transaction holding the work and the completion commits. Work whose
transaction was marked for rollback comes back as ``RolledBack``; work that
cannot be made atomic with its outcome (a durable block, a write to another
database) raises ``CannotBeAtomic`` naming the fix.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import (
    DatabaseError,
    Error,
    InterfaceError,
    OperationalError,
    connections,
    transaction,
)

from idempotency_app import signals, store, work
from idempotency_app.conf import conf
from idempotency_app.exceptions import OutcomeUnknown, StoreUnavailable, TransactionEnded
from idempotency_app.store import Identity, StoredResponse
from idempotency_app.work import UnitAtomic

logger = logging.getLogger("idempotency_app")

T = TypeVar("T")

# How often a claim is retried when the record it met vanished or was taken
# over by someone else in between; each retry is a fresh INSERT.
MAX_CLAIM_ATTEMPTS = 5
POLL_INTERVAL = 0.05


@dataclass(frozen=True)
class Claim:
    identity: Identity
    token: str
    using: str
    # Claimed inside the caller's transaction: invisible to other workers
    # until that transaction commits, so its lease means nothing to them.
    nested: bool = False
    # That transaction's outermost atomic block, to tell when it has ended.
    origin: Any = field(default=None, compare=False, repr=False)
    # A validation error may have been answered for this key in the last
    # TRANSIENT_ERROR_TTL: worth asking the retry-storm guard, which is keyed
    # by the whole identity. True when the claim took over a live marker such
    # an error leaves, whatever body left it (a client alternating between
    # two bad bodies leaves the other's), and when nested (a nested release
    # rolls back, marker included).
    guarded: bool = False

    def uncommitted(self) -> bool:
        """Whether the claim is still inside the transaction that made it."""
        if not self.nested:
            return False
        blocks = connections[self.using].atomic_blocks
        if self.origin is None:  # a transaction managed by hand
            return in_transaction(self.using)
        return bool(blocks) and blocks[0] is self.origin


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


@dataclass(frozen=True)
class RolledBack(Generic[T]):
    """The work returned an outcome to store, but its transaction was marked
    for rollback (a caught database error, ``set_rollback(True)``, a failed
    ``atomic(savepoint=False)``) or failed to commit: nothing was stored and
    the key was released. Reporting ``value`` as a success would be a lie."""

    value: T


Decision = Claim | Replay | InProgress | Mismatch


class Marked:
    """What ``settle`` returns to release a claim leaving a marker: the next
    claim of the key meets it for free and knows a validation error was
    answered (cached by the caller) a moment ago."""


MARKED = Marked()


def policy_problems(ttl: float, lease: float, wait: float) -> list[str]:
    """What makes a combination of durations unsafe, in words. Per-view and
    per-call options may be shorter than the settings allow (a task's TTL of
    a few seconds, say), never unsafe."""
    problems = []
    if not 0 < ttl < math.inf:
        problems.append(f"TTL is {ttl:g}s; it must be a positive number of seconds.")
    if not 0 < lease < math.inf:
        problems.append(f"LEASE is {lease:g}s; it must be a positive number of seconds.")
    if not 0 <= wait < lease:
        problems.append(
            f"WAIT_FOR_IN_FLIGHT is {wait:g}s; it must be at least 0 and shorter than "
            f"LEASE ({lease:g}s), or a waiting duplicate could take over a live request."
        )
    return problems


@dataclass(frozen=True)
class Policy:
    ttl: float
    lease: float
    wait: float
    using: str
    # How long a released claim leaves its marker (TRANSIENT_ERROR_TTL).
    marker: float = 0.0

    @classmethod
    def from_settings(
        cls, ttl: float | None = None, lease: float | None = None, wait: float | None = None
    ) -> Policy:
        policy = cls(
            ttl=conf.TTL if ttl is None else ttl,
            lease=conf.LEASE if lease is None else lease,
            wait=conf.WAIT_FOR_IN_FLIGHT if wait is None else wait,
            using=conf.DATABASE_ALIAS,
            marker=conf.TRANSIENT_ERROR_TTL,
        )
        if ttl is not None or lease is not None or wait is not None:
            problems = policy_problems(policy.ttl, policy.lease, policy.wait)
            if problems:
                raise ImproperlyConfigured(
                    "Per-call idempotency options combined with the IDEMPOTENCY setting: "
                    + " ".join(problems)
                )
        return policy


def in_transaction(using: str) -> bool:
    """Whether a transaction is open on ``using``; never touches the network,
    so it is safe to ask while the database is down."""
    connection = connections[using]
    return connection.in_atomic_block or (
        connection.connection is not None and not connection.autocommit
    )


# -- claiming ----------------------------------------------------------------


@signals.timed(signals.claim_timed)
def claim(identity: Identity, policy: Policy) -> Decision:
    """One INSERT arbitrated by the unique constraint decides who runs.

    A lock timeout or deadlock while claiming means another request holds the
    key's row inside a transaction: that is a 409, not an outage. Outside a
    transaction the failed statement left nothing behind, so it is retried
    like any duplicate in flight, within ``policy.wait``. A connection that
    broke since its last use (the database restarted) is replaced once.
    Any other database error is ``StoreUnavailable``.
    """
    store.check_storable(identity, policy.using)
    deadline = time.monotonic() + policy.wait
    # One token for every attempt: a statement whose answer was lost with
    # its connection may have claimed the key, and the token recognises it.
    token = secrets.token_hex(16)
    reconnected = False
    while True:
        try:
            return _claim(identity, policy, deadline, token)
        except Error as exc:
            nested = in_transaction(policy.using)
            if connections[policy.using].in_atomic_block:
                # The failed statement spoiled the enclosing savepoint.
                transaction.set_rollback(True, using=policy.using)
            if is_lock_conflict(exc):
                logger.info("Lock conflict claiming idempotency key %r: %s", identity.key, exc)
                # Inside a transaction, a deadlock may have rolled back more
                # than our statement: retrying there would build on lost work.
                if nested or time.monotonic() >= deadline:
                    signals.conflict.send(Claim, identity=identity)
                    return InProgress()
                time.sleep(POLL_INTERVAL)
                continue
            if not nested and not reconnected and _is_disconnect(exc):
                reconnected = True
                _close_quietly(policy.using)
                continue
            logger.error("Idempotency claim failed for %r: %s", identity.key, exc)
            signals.store_unavailable.send(Claim, identity=identity)
            raise StoreUnavailable(str(exc)) from exc


# MySQL lock wait timeout and deadlock; PostgreSQL deadlock, lock timeout and
# serialization failure.
_MYSQL_LOCK_ERRORS = {1205, 1213}
_POSTGRES_LOCK_STATES = {"40P01", "55P03", "40001"}


def is_lock_conflict(exc: Exception) -> bool:
    cause = exc.__cause__ or exc
    if getattr(cause, "sqlstate", None) in _POSTGRES_LOCK_STATES:
        return True
    if getattr(cause, "pgcode", None) in _POSTGRES_LOCK_STATES:
        return True
    args = getattr(cause, "args", ())
    if args and args[0] in _MYSQL_LOCK_ERRORS:
        return True
    # SQLite: "database is locked", or "database table is locked" with a
    # shared cache (in-memory test databases).
    return "database is locked" in str(exc) or "database table is locked" in str(exc)


def _is_disconnect(exc: Exception) -> bool:
    return isinstance(exc, (OperationalError, InterfaceError))


def _close_quietly(using: str) -> None:
    with contextlib.suppress(Error):
        connections[using].close()


def _claim(identity: Identity, policy: Policy, deadline: float, token: str) -> Decision:
    using = policy.using
    nested = in_transaction(using)
    blocks = connections[using].atomic_blocks
    origin = blocks[0] if nested and blocks else None
    for _ in range(MAX_CLAIM_ATTEMPTS):
        found = store.insert_or_fetch(identity, token, policy.ttl, policy.lease, using)
        while isinstance(found, store.Existing):
            if found.token == token:
                break  # our own INSERT or takeover, whose answer was lost
            if found.released:
                # A validation error's marker: nobody's work, taken over by
                # the next claim, corrected or not.
                if store.take_over(identity, found.token, token, policy.ttl, policy.lease, using):
                    guarded = nested or not found.expired
                    return Claim(identity, token, using, nested, origin, guarded)
                found = None
                break
            # An in-progress claim is judged by its lease alone: a per-view TTL
            # shorter than the lease (or a renewed lease) must not let a
            # duplicate take over work that is still running.
            if found.expired and (found.status != store.IN_PROGRESS or found.lapsed):
                if store.take_over(identity, found.token, token, policy.ttl, policy.lease, using):
                    return Claim(identity, token, using, nested, origin, nested)
                found = None
                break
            if not found.matches(identity):
                signals.mismatch.send(Claim, identity=identity)
                return Mismatch()
            if found.response is not None:
                signals.replayed.send(Claim, identity=identity)
                return Replay(found.response)
            if found.interrupted:
                raise OutcomeUnknown(identity.key)
            if found.lapsed:
                if store.take_over(identity, found.token, token, policy.ttl, policy.lease, using):
                    logger.warning("Took over the lapsed claim on idempotency key %r", identity.key)
                    signals.takeover.send(Claim, identity=identity)
                    return Claim(identity, token, using, nested, origin, nested)
                found = None
                break
            if time.monotonic() >= deadline or connections[using].in_atomic_block:
                signals.conflict.send(Claim, identity=identity)
                return InProgress()
            time.sleep(POLL_INTERVAL)
            found = store.fetch(identity, using)
        if found is store.CLAIMED or isinstance(found, store.Existing):
            return Claim(identity, token, using, nested, origin, nested)
    signals.conflict.send(Claim, identity=identity)
    return InProgress()


# -- running -----------------------------------------------------------------

# The (alias, scope, key) this context is running work for. A handler that
# calls another handler covered for the same key (a viewset's partial_update
# calling update) is part of the same execution, not a duplicate of it.
_running: contextvars.ContextVar[Mapping[tuple[str, str, str], Claim]] = contextvars.ContextVar(
    "idempotency_running", default=MappingProxyType({})
)


def running(identity: Identity, using: str) -> Claim | None:
    """The claim this context is running work under for ``identity``'s key."""
    return _running.get().get((using, identity.scope, identity.key))


@contextlib.contextmanager
def _mark_running(held: Claim) -> Iterator[None]:
    key = (held.using, held.identity.scope, held.identity.key)
    reset = _running.set({**_running.get(), key: held})
    try:
        yield
    finally:
        _running.reset(reset)


def run(
    identity: Identity,
    work: Callable[[], T],
    settle: Callable[[T], StoredResponse | Marked | None],
    policy: Policy,
) -> Executed[T] | RolledBack[T] | Replay | InProgress | Mismatch:
    """Run ``work`` once for ``identity``.

    ``settle`` turns the work's value into what to store, or None to release
    the claim (and roll the work back) so that a retry runs again. An
    exception from ``work`` releases the claim and propagates.
    """
    if running(identity, policy.using) is not None:
        return Executed(work(), None)  # the enclosing run settles it
    with claimed(identity, policy) as decision:
        if not isinstance(decision, Claim):
            return decision
        return execute(decision, work, settle, policy)


@contextlib.contextmanager
def claimed(identity: Identity, policy: Policy) -> Iterator[Decision]:
    """The claim's decision, for the body to run the work under. Inside a
    transaction (nested mode) the claim, the work and the completion share
    one savepoint, so a release is its rollback."""
    nested = in_transaction(policy.using)
    with UnitAtomic(policy.using) if nested else contextlib.nullcontext():
        yield claim(identity, policy)


def execute(
    held: Claim,
    work: Callable[[], T],
    settle: Callable[[T], StoredResponse | Marked | None],
    policy: Policy,
) -> Executed[T] | RolledBack[T] | InProgress:
    """The work and the completion commit together or not at all."""
    with unit_of_work(held, policy) as unit:
        value = work()
        unit.finish(value, settle(value))
    return unit.outcome()


class Unit(Generic[T]):
    """The work under one claim, between ``unit_of_work``'s start and end;
    the work hands its value and what to store to ``finish``."""

    def __init__(self, held: Claim, policy: Policy) -> None:
        self.held = held
        self.policy = policy
        self.result: Executed[T] | RolledBack[T] | InProgress | None = None
        self.marked = False

    def finish(self, value: T, response: StoredResponse | Marked | None) -> None:
        """Inside the work's transaction: complete the claim with
        ``response``, or (None, MARKED) mark the transaction for rollback."""
        held = self.held
        if response is None or isinstance(response, Marked):
            transaction.set_rollback(True, using=held.using)
            self.result = Executed(value, None)
            self.marked = isinstance(response, Marked)
            return
        if connections[held.using].needs_rollback:
            self.result = RolledBack(value)
            return
        try:
            completed = store.complete(
                held.identity, held.token, response, self.policy.ttl, held.using
            )
        except DatabaseError as exc:
            transaction.set_rollback(True, using=held.using)
            if is_lock_conflict(exc):
                # The record changed under the work's snapshot (a takeover at
                # REPEATABLE READ) or a deadlock: lost like a takeover, a 409.
                logger.warning(
                    "Rolled back work on idempotency key %r: completing it met %s",
                    held.identity.key,
                    exc,
                )
                self.result = InProgress()
                return
            if isinstance(exc, (OperationalError, InterfaceError)):
                raise StoreUnavailable(str(exc)) from exc
            # The work left the transaction unusable (PostgreSQL aborts it at
            # the first failed statement, even one the work caught).
            logger.error(
                "Could not store the outcome of idempotency key %r (%s): the work's "
                "transaction was unusable, so nothing it did was kept. Wrap a statement whose "
                "database error you catch in its own transaction.atomic().",
                held.identity.key,
                exc,
            )
            self.result = RolledBack(value)
            return
        if completed:
            self.result = Executed(value, response)
            return
        transaction.set_rollback(True, using=held.using)
        logger.warning(
            "Rolled back work on idempotency key %r: its claim was taken over", held.identity.key
        )
        self.result = InProgress()

    def stored(self) -> bool:
        return isinstance(self.result, Executed) and self.result.stored is not None

    def outcome(self) -> Executed[T] | RolledBack[T] | InProgress:
        if self.result is None:
            raise RuntimeError("The work ended without calling finish().")
        return self.result


@contextlib.contextmanager
def unit_of_work(held: Claim, policy: Policy) -> Iterator[Unit[Any]]:
    """The work and its completion, committed together.

    In atomic mode this opens the transaction; a nested claim is already
    inside the caller's savepoint. While the work runs it may write only
    through the claim's database, and a durable block is refused, both with
    ``CannotBeAtomic``. A claim that ends without a stored outcome is
    released. A failure at the commit itself is told apart from an
    ``on_commit`` hook failing after it: the first is read back from the
    record (a commit whose answer was lost is the success it was; one that
    did not land is ``RolledBack`` or ``StoreUnavailable``), the second
    propagates, the outcome being stored.
    """
    unit: Unit[Any] = Unit(held, policy)
    body_done = False
    try:
        with contextlib.nullcontext() if held.nested else UnitAtomic(held.using):
            with _mark_running(held), work.confined(held.identity, held.using):
                yield unit
            unit.outcome()
            body_done = True
    except TransactionEnded as exc:
        if _keep_interrupted(held, policy):
            raise OutcomeUnknown(held.identity.key) from exc
        raise  # the claim was not there to keep: its transaction rolled back, work and all
    except BaseException as exc:
        try:
            if body_done and unit.stored() and not held.nested:
                if _hook_failed(held.using):
                    raise  # an on_commit hook failed after the commit, as Django reports it
                if _completed(held):
                    return  # the commit landed, only its answer was lost: the success stands
                release_quietly(held)
                assert isinstance(unit.result, Executed)
                unit.result = _uncommitted(held, unit.result.value, exc)
                return
            release_quietly(held)
            raise
        except StoreUnavailable:
            # At the completion or the commit; sent once the work is over.
            signals.store_unavailable.send(Claim, identity=held.identity)
            raise
    if not unit.stored():
        release_quietly(held, policy.marker if unit.marked else 0)
    if isinstance(unit.result, InProgress):
        # Sent once the work is over, so that no receiver's writes are part of it.
        signals.conflict.send(Claim, identity=held.identity)


def _keep_interrupted(held: Claim, policy: Policy) -> bool:
    """The work ended its own transaction, so part of it may have committed:
    its claim is kept as interrupted, never released, so that no retry runs
    it again. False when the claim rolled back with that transaction."""
    try:
        kept = store.interrupt(held.identity, held.token, policy.ttl, held.using)
    except Error:
        logger.exception(
            "Could not mark idempotency key %r interrupted: its claim frees when its lease "
            "ends, and a retry may then run the work again",
            held.identity.key,
        )
        kept = True  # the claim may well be there: never answer as if it rolled back
    if kept:
        logger.error(
            "The work on idempotency key %r ended its own transaction, so part of it may have "
            "committed: the key answers request_outcome_unknown until an operator releases it",
            held.identity.key,
        )
        signals.interrupted.send(Claim, identity=held.identity)
    return kept


def _hook_failed(using: str) -> bool:
    """Django sets this flag once a commit succeeded and clears it when its
    on_commit hooks have all run: still set, one of them raised."""
    return bool(getattr(connections[using], "run_commit_hooks_on_set_autocommit_on", False))


def _completed(held: Claim) -> bool:
    """After a failure around the commit: did our completion commit anyway?
    Unknown (the database is unreachable) counts as no: a retry learns."""
    try:
        found = store.fetch(held.identity, held.using)
    except Error:
        return False
    return found is not None and found.token == held.token and found.response is not None


def _uncommitted(held: Claim, value: T, exc: BaseException) -> RolledBack[T]:
    """The commit failed: the outcome to report instead of the success. A
    serialization failure is the work's, not the database's: rolled back."""
    if isinstance(exc, (OperationalError, InterfaceError)) and not is_lock_conflict(exc):
        raise StoreUnavailable(str(exc)) from exc
    if not isinstance(exc, DatabaseError):
        raise exc
    logger.error(
        "The work on idempotency key %r did not commit (%s); its outcome was not stored",
        held.identity.key,
        exc,
    )
    return RolledBack(value)


def release_quietly(held: Claim, marker: float = 0) -> None:
    """Release after a failure; if the database is the failure, the lease
    expiring is the fallback, and the original error is what matters."""
    if held.nested:
        return  # the claim rolls back with the caller's transaction
    try:
        store.release(held.identity, held.token, held.using, marker)
    except Error:
        logger.exception(
            "Could not release idempotency key %r; it frees when its lease ends", held.identity.key
        )
