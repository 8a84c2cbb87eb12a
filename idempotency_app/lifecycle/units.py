"""The unit of work: run the work under a claim, then complete or let go.
No HTTP here.

The work and its completion commit together, in the claim's transaction
(``Claim.transaction()``), or not at all: an outcome is stored, and
reported as such, only if that transaction commits. While the work runs,
``work.confined`` refuses what could not commit with it.

``run`` answers with ``Executed`` (the work ran; ``stored`` says what was
stored, or None when the claim was let go) or ``Replay`` (the key was
completed before), and raises for everything else: ``KeyInProgress``
(another worker holds the key; ``ClaimLost`` when ours was taken over while
the work ran), ``KeyReused``, ``WorkRolledBack`` (the work's transaction was
marked for rollback or failed to commit: ``value`` is what the work
returned), ``OutcomeUnknown``, ``StoreUnavailable`` and ``CannotBeAtomic``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from django.db import (
    DatabaseError,
    Error,
    connections,
    transaction,
)

from idempotency_app import signals, store
from idempotency_app.exceptions import (
    ClaimLost,
    OutcomeUnknown,
    StoreUnavailable,
    TransactionEnded,
    WorkRolledBack,
)
from idempotency_app.lifecycle import replays, work
from idempotency_app.lifecycle.claims import (
    AtomicClaim,
    Claim,
    Policy,
    Replay,
    arbitrate,
    remembered,
)
from idempotency_app.lifecycle.drivers import is_lock_conflict, is_outage
from idempotency_app.lifecycle.work import UnitAtomic
from idempotency_app.store import Existing, Identity, StoredResponse
from idempotency_app.store.base import judging_per_unit, runs_alone

logger = logging.getLogger("idempotency_app")

T = TypeVar("T")


@dataclass(frozen=True)
class Executed(Generic[T]):
    """The work ran. ``stored``: what was stored, or None when it was let go."""

    value: T
    stored: StoredResponse | None


class Marked:
    """What ``settle`` returns to let go of a claim leaving a marker: the
    next claim of the key meets it for free and knows a validation error was
    answered (cached by the caller) a moment ago."""


MARKED = Marked()

# What settle makes of the work's value: a response to store, None to let
# the claim go (and roll the work back), or MARKED.
Settle = Callable[[T], StoredResponse | Marked | None]

# The (alias, scope, key) this context is running work for. A handler that
# calls another handler covered for the same key (a viewset's partial_update
# calling update) is part of the same execution, not a duplicate of it.
_running: contextvars.ContextVar[Mapping[tuple[str, str, str], Claim]] = contextvars.ContextVar(
    "idempotency_running", default=MappingProxyType({})
)


def running(identity: Identity, using: str) -> Claim | None:
    """The claim this context is running work under for ``identity``'s key."""
    return _running.get().get((using, identity.scope, identity.key))


def _mark_running(held: Claim) -> contextvars.Token[Mapping[tuple[str, str, str], Claim]]:
    """Mark this context as running ``held``'s work until the token is reset."""
    key = (held.using, held.identity.scope, held.identity.key)
    return _running.set({**_running.get(), key: held})


def run(
    identity: Identity, work: Callable[[], T], settle: Settle[T], policy: Policy
) -> Executed[T] | Replay:
    """Run ``work`` once for ``identity``. An exception from ``work`` lets
    the claim go and propagates."""
    if running(identity, policy.using) is not None:
        return Executed(work(), None)  # the enclosing run settles it
    with claimed(identity, policy) as decision:
        if isinstance(decision, Replay):
            return decision
        return execute(decision, work, settle)


def held_replay(identity: Identity, using: str) -> Replay | None:
    """The replay ``REPLAY_CACHE`` holds for ``identity``, decided before
    anything else, or None. Only outside a transaction: inside one, a
    replayed ``once()`` block must run in the claim's savepoint (``claimed``)."""
    cached = replays.get(identity, using)
    if cached is None or not runs_alone(connections[using]):
        return None
    return remembered(identity, cached)


@contextlib.contextmanager
def claimed(identity: Identity, policy: Policy) -> Iterator[Claim | Replay]:
    """The claim's decision, for the body to run the work under. Inside a
    transaction the claim, the work and the completion share one savepoint,
    so letting go is its rollback (a replayed ``once()`` block runs in it
    too)."""
    held = held_replay(identity, policy.using)
    if held is not None:
        yield held
        return
    connection = connections[policy.using]
    with judging_per_unit():
        if runs_alone(connection):
            yield arbitrate(identity, policy, connection)
        else:
            with UnitAtomic(policy.using):
                cached = replays.get(identity, policy.using)
                if cached is not None:
                    yield remembered(identity, cached)
                else:
                    yield arbitrate(identity, policy, connection)


def execute(held: Claim, work: Callable[[], T], settle: Settle[T]) -> Executed[T]:
    """The work and the completion commit together or not at all."""
    with unit_of_work(held) as unit:
        value = work()
        unit.finish(value, settle(value))
    return unit.outcome()


class Unit(Generic[T]):
    """The work under one claim, between ``unit_of_work``'s start and end;
    the work hands its value and what to store to ``finish``."""

    def __init__(self, held: Claim) -> None:
        self.held = held
        self.result: Executed[T] | None = None
        self.failure: WorkRolledBack | ClaimLost | None = None
        self.marked = False
        self.value: Any = None
        # What finish() left for complete() to store, and when it was sent.
        self.pending: StoredResponse | None = None
        self.sent_at = 0.0
        # The claim's connection in this thread, once the work runs.
        self.connection: Any = None

    def finish(self, value: T, response: StoredResponse | Marked | None) -> None:
        """Inside the work's transaction: keep ``response`` for ``complete``,
        or (None, MARKED) mark the transaction for rollback."""
        connection = self.connection
        self.value = value
        if response is None or isinstance(response, Marked):
            connection.set_rollback(True)
            self.result = Executed(value, None)
            self.marked = isinstance(response, Marked)
            return
        if connection.get_rollback() or work.rolled_back_by_the_server():
            connection.set_rollback(True)
            self.failure = WorkRolledBack(self.held.key, value)
            return
        self.pending = response

    def complete(self, unsent: list[str]) -> None:
        """Once the work is over, in its transaction: store the outcome.
        The claim's own transaction (not a savepoint) may commit in the same
        round trip; an error then leaves it unknown whether it committed,
        which ``unit_of_work`` reads back as for a failed commit. ``unsent``:
        the work's releases not sent yet, which go in front of the completion
        where the driver takes several statements at once, or else alone
        before it, an error of theirs being the work's."""
        held, response = self.held, self.pending
        if response is None:
            return  # rolled back: nothing of the work is kept
        commits = isinstance(held, AtomicClaim)
        records = store.backend(held.using)
        connection = self.connection
        if unsent and not records.carries_statements(connection):
            work.send_alone(connection, unsent)
            unsent = []
        self.sent_at = time.monotonic()  # the record's TTL runs from about here
        try:
            completed = records.complete(
                held.identity,
                held.token,
                response,
                held.policy.ttl,
                commit=commits,
                before=unsent,
                connection=connection,
            )
        except DatabaseError as exc:
            transaction.set_rollback(True, using=held.using)
            if commits:
                # From the completion or from a COMMIT sent with it: what the
                # record says now decides (``_after_failed_commit``).
                self.result = Executed(self.value, response)
                raise
            if is_lock_conflict(exc):
                # The record changed under the work's snapshot (a takeover at
                # REPEATABLE READ) or a deadlock: lost like a takeover, a 409.
                logger.warning(
                    "Rolled back work on idempotency key %r: completing it met %s", held.key, exc
                )
                self.failure = ClaimLost(held.key)
                return
            if is_outage(exc):
                raise StoreUnavailable(str(exc)) from exc
            # The work left the transaction unusable (PostgreSQL aborts it at
            # the first failed statement, even one the work caught).
            logger.error(
                "Could not store the outcome of idempotency key %r (%s): the work's "
                "transaction was unusable, so nothing it did was kept. Wrap a statement whose "
                "database error you catch in its own transaction.atomic().",
                held.key,
                exc,
            )
            self.failure = WorkRolledBack(held.key, self.value)
            return
        if completed:
            self.result = Executed(self.value, response)
            return
        transaction.set_rollback(True, using=held.using)
        logger.warning("Rolled back work on idempotency key %r: its claim was taken over", held.key)
        self.failure = ClaimLost(held.key)

    def stored(self) -> bool:
        return self.result is not None and self.result.stored is not None

    def outcome(self) -> Executed[T]:
        """What the work came to, once its transaction has ended; raises
        ``WorkRolledBack`` or ``ClaimLost`` when it came to nothing."""
        if self.failure is not None:
            try:
                raise self.failure
            finally:
                self.failure = None  # its traceback holds this frame, and so this unit
        assert self.result is not None  # unit_of_work saw to it
        return self.result


@contextlib.contextmanager
def unit_of_work(held: Claim) -> Iterator[Unit[Any]]:
    """The work and its completion, committed together in the claim's
    transaction. While the work runs it may write only through the claim's
    database, and a durable block is refused, both with ``CannotBeAtomic``.
    A claim that ends without a stored outcome is let go; one whose work
    ended its own transaction is kept, interrupted (``OutcomeUnknown``).
    """
    unit: Unit[Any] = Unit(held)
    body_done = False
    since = replays.generation()
    try:
        with held.transaction():
            marked = _mark_running(held)
            try:
                with work.confined(held.identity, held.using) as confinement:
                    unit.connection = confinement.connection
                    yield unit
                    if unit.pending is None and unit.result is None and unit.failure is None:
                        raise RuntimeError("The work ended without calling finish().")
            finally:
                _running.reset(marked)
            body_done = True
            unit.complete(confinement.unsent_releases())
    except TransactionEnded as exc:
        if _keep_interrupted(held):
            raise OutcomeUnknown(held.key) from exc
        raise  # the claim was not there to keep: its transaction rolled back, work and all
    except BaseException as exc:
        try:
            if body_done and unit.stored() and isinstance(held, AtomicClaim):
                unit.failure = _after_failed_commit(held, unit, exc)
                if unit.failure is None:
                    return  # the commit landed, only its answer was lost: the success stands
                held.let_go()
                if isinstance(unit.failure, ClaimLost):
                    signals.conflict.send(Claim, identity=held.identity)
                return
            held.let_go()
            raise
        except StoreUnavailable:
            # At the completion or the commit; sent once the work is over.
            signals.store_unavailable.send(Claim, identity=held.identity)
            raise
    if not unit.stored():
        held.let_go(held.policy.marker if unit.marked else 0)
    elif isinstance(held, AtomicClaim):  # committed: its retries may skip the database
        assert unit.result is not None and unit.result.stored is not None
        lived = time.monotonic() - unit.sent_at  # the COMMIT and its on_commit hooks
        replays.put(held.identity, held.using, unit.result.stored, since, held.policy.ttl - lived)
    if isinstance(unit.failure, ClaimLost):
        # Sent once the work is over, so that no receiver's writes are part of it.
        signals.conflict.send(Claim, identity=held.identity)


def _after_failed_commit(
    held: AtomicClaim, unit: Unit[Any], exc: BaseException
) -> WorkRolledBack | ClaimLost | None:
    """The transaction holding a stored outcome failed around its commit (on
    PostgreSQL the completion and the COMMIT are one message, so any error of
    either lands here). An ``on_commit`` hook that raised after the commit
    propagates as Django reports it (the outcome is stored). Otherwise the
    record is read back: a commit whose answer was lost is the success it
    was (None); a claim that another worker took over (or that is gone) was
    lost, a 409; otherwise the work is rolled back, or ``StoreUnavailable``
    when the database could not answer. A serialization failure is the
    work's, and so is a savepoint error: the work's release, sent with the
    COMMIT, of a savepoint it had rolled back past or released already."""
    if _hook_failed(held.using):
        raise exc
    readable, found = _read_back(held)
    if found is not None and found.token == held.token and found.response is not None:
        return None
    if readable and (found is None or found.token != held.token):
        logger.warning("Rolled back work on idempotency key %r: its claim was taken over", held.key)
        return ClaimLost(held.key)
    if is_outage(exc):
        held.let_go()
        raise StoreUnavailable(str(exc)) from exc
    if not isinstance(exc, DatabaseError):
        held.let_go()
        raise exc
    logger.error(
        "The work on idempotency key %r did not commit (%s); its outcome was not stored",
        held.key,
        exc,
    )
    assert unit.result is not None
    return WorkRolledBack(held.key, unit.result.value)


def _keep_interrupted(held: Claim) -> bool:
    """The work ended its own transaction, so part of it may have committed:
    its claim is kept as interrupted, never let go, so that no retry runs it
    again. False when the claim rolled back with that transaction."""
    try:
        # On a connection of its own, which an enclosing unit's guard would
        # refuse as another connection's write.
        with work.by_the_library():
            kept = store.backend(held.using).interrupt(held.identity, held.token, held.policy.ttl)
    except Error:
        logger.exception(
            "Could not mark idempotency key %r interrupted: its claim frees when its lease "
            "ends, and a retry may then run the work again",
            held.key,
        )
        kept = True  # the claim may well be there: never answer as if it rolled back
    if kept:
        logger.error(
            "The work on idempotency key %r ended its own transaction, so part of it may have "
            "committed: the key answers request_outcome_unknown until an operator releases it",
            held.key,
        )
        signals.interrupted.send(Claim, identity=held.identity)
    return kept


def _hook_failed(using: str) -> bool:
    """Django sets this flag once a commit succeeded and clears it when its
    on_commit hooks have all run: still set, one of them raised."""
    return bool(getattr(connections[using], "run_commit_hooks_on_set_autocommit_on", False))


def _read_back(held: Claim) -> tuple[bool, Existing | None]:
    """After a failure around the commit: whether the record could be read,
    and the record. Unreadable (the database is unreachable) counts as not
    completed: a retry learns."""
    try:
        return True, store.backend(held.using).fetch(held.identity)
    except Error:
        return False, None


def refuse_generator(func: Callable[..., Any], decorator: str) -> None:
    """A generator's work runs while it is iterated, after the call has
    returned and its claim has been settled: nothing could cover it."""
    if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        raise TypeError(
            f"{decorator} cannot wrap the generator {func.__qualname__}: its work runs while "
            "it is iterated, after the call has returned, so no claim could cover it. Return "
            "a list (or, in a view, a response) instead of yielding."
        )
