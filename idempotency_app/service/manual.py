"""Driving a claim by hand: claim, complete (one or many), release, renew."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction

from idempotency_app import core, signals, store
from idempotency_app.exceptions import (
    ClaimLost,
    KeyInProgress,
    KeyReused,
    StoreUnavailable,
    WorkRolledBack,
)
from idempotency_app.service.results import (
    RESULT_STATUS,
    decode,
    derive_key,
    encode,
    make_identity,
    stored_result,
)
from idempotency_app.store import Identity


@dataclass(frozen=True)
class Held:
    """A claim this worker owns: ``complete`` it or ``release`` it."""

    identity: Identity
    token: str
    policy: core.Policy
    # Claimed inside the caller's transaction: it commits or rolls back with it.
    nested: bool = False
    origin: Any = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> str:
        return self.identity.key

    def derive_key(self, label: str) -> str:
        return derive_key(self.identity.scope, self.identity.key, label)

    def core_claim(self) -> core.Claim:
        return core.Claim(self.identity, self.token, self.policy.using, self.nested, self.origin)


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
    return decide(core.claim(identity, policy), identity, policy)


def held_from(claim: core.Claim, policy: core.Policy) -> Held:
    return Held(claim.identity, claim.token, policy, claim.nested, claim.origin)


def decide(decision: core.Decision, identity: Identity, policy: core.Policy) -> Held | Done:
    """What the service API makes of a claim's decision."""
    if isinstance(decision, core.Claim):
        return held_from(decision, policy)
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
    pending = [(held, stored_result(encode(result))) for held, result in items]
    if not pending:
        return []
    using = pending[0][0].policy.using
    if any(held.policy.using != using for held, _ in pending):
        raise ValueError("complete_many() needs claims on one database.")
    if connections[using].needs_rollback:
        # The caller's transaction will roll back: storing now would report
        # a success that never commits.
        raise WorkRolledBack(pending[0][0].key)
    lost = None
    try:
        with transaction.atomic(using=using):
            for held, response in pending:
                lost = held
                if not store.complete(held.identity, held.token, response, held.policy.ttl, using):
                    raise ClaimLost(held.key)
            lost = None
    except (OperationalError, InterfaceError) as exc:
        if not core.is_lock_conflict(exc):
            raise StoreUnavailable(str(exc)) from exc
        # The record changed under the caller's snapshot (a takeover at
        # REPEATABLE READ) or a deadlock, at an UPDATE or at the commit: the
        # claim is lost, not the database.
        failed = lost or pending[0][0]
        _lose(failed, using)
        raise ClaimLost(failed.key) from exc
    except ClaimLost:
        assert lost is not None
        _lose(lost, using)
        raise
    for held, _ in pending:
        signals.executed.send(core.Claim, identity=held.identity, status=RESULT_STATUS)
    return [decode(response) for _, response in pending]


def _lose(lost: Held, using: str) -> None:
    if connections[using].in_atomic_block:
        # The work in the caller's transaction must not commit either, even
        # if the caller catches ClaimLost and carries on.
        transaction.set_rollback(True, using=using)
    signals.conflict.send(core.Claim, identity=lost.identity)


def release(held: Held) -> bool:
    """Give up an unfinished claim so that a retry runs again.

    A completed result is never deleted, so a release in an ``except`` that
    also covers code after ``complete`` cannot cause a second run. False
    when the claim was completed, released or taken over.
    """
    return store.release(held.identity, held.token, held.policy.using)


def renew(held: Held, lease: float | None = None) -> bool:
    """Extend the lease of a long run; False if the claim was taken over.

    From inside the work's transaction (``once()``, ``@idempotent_task``)
    the new lease usually commits at once, through a connection of its own,
    so other workers see it and no row lock is held until the work commits;
    ``_renews_in_place`` says when the work's own transaction carries it
    instead. A claim still inside the transaction that made it is invisible
    to others until that commits, so its lease needs no renewing (True).
    """
    seconds = held.policy.lease if lease is None else lease
    using = held.policy.using
    if held.core_claim().uncommitted():
        return True
    if not core.in_transaction(using):
        return store.renew(held.identity, held.token, seconds, using)
    if _renews_in_place(using):
        try:
            return store.renew(held.identity, held.token, seconds, using)
        except DatabaseError as exc:
            if not core.is_lock_conflict(exc):
                raise
            # Taken over after the work's snapshot: the work must not commit.
            transaction.set_rollback(True, using=using)
            return False
    side = connections.create_connection(using)
    try:
        return store.renew(held.identity, held.token, seconds, using, side)
    finally:
        side.close()


def _renews_in_place(using: str) -> bool:
    """Whether the work's own transaction must carry the new lease, which
    then holds the row: duplicates and the sweep wait at it until the work
    ends (a lock_timeout turns that wait into a 409), rather than see the
    lease. SQLite has one writer, so a second connection would wait for the
    work anyway. On PostgreSQL at REPEATABLE READ or SERIALIZABLE, the work
    could not complete a row that another connection changed after its
    snapshot. A transaction already marked for rollback takes no statement:
    it commits nothing, so the side connection serves."""
    vendor = store.vendor(using)
    if vendor == "sqlite":
        return True
    if vendor != "postgresql" or connections[using].needs_rollback:
        return False
    return store.isolation_level(using) not in ("read committed", "read uncommitted")
