"""Driving a claim by hand: claim, complete (one or many), release, renew."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction

from idempotency_app import signals, store
from idempotency_app.exceptions import ClaimLost, StoreUnavailable, WorkRolledBack
from idempotency_app.lifecycle import claims, work
from idempotency_app.lifecycle.claims import (
    Claim,
    Policy,
    Replay,
    in_transaction,
)
from idempotency_app.lifecycle.drivers import is_lock_conflict
from idempotency_app.service.results import (
    TASK_STATUS,
    decode,
    encode,
    make_identity,
    stored_result,
)

# The claim the service API hands out: complete it or release it.
Held = Claim


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
    for another operation or fingerprint, ``OutcomeUnknown`` when its work
    was interrupted, ``StoreUnavailable`` when the database cannot answer.
    The claim commits at once unless the caller is inside a transaction.
    """
    identity = make_identity(scope, key, operation, fingerprint)
    return decide(claims.claim(identity, Policy.from_settings(ttl, lease, wait)))


def decide(decision: Held | Replay) -> Held | Done:
    """What the service API makes of a claim's decision."""
    return Done(decode(decision.response)) if isinstance(decision, Replay) else decision


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
    if connections[using].in_atomic_block and transaction.get_rollback(using=using):
        # The caller's transaction will roll back: storing now would report
        # a success that never commits.
        raise WorkRolledBack(pending[0][0].key)
    lost = None
    records = store.backend(using)
    try:
        with transaction.atomic(using=using):
            for held, response in pending:
                lost = held
                if not records.complete(held.identity, held.token, response, held.policy.ttl):
                    raise ClaimLost(held.key)
            lost = None
    except (OperationalError, InterfaceError) as exc:
        if not is_lock_conflict(exc):
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
        signals.executed.send(Claim, identity=held.identity, status=TASK_STATUS)
    return [decode(response) for _, response in pending]


def _lose(lost: Held, using: str) -> None:
    if connections[using].in_atomic_block:
        # The work in the caller's transaction must not commit either, even
        # if the caller catches ClaimLost and carries on.
        transaction.set_rollback(True, using=using)
    signals.conflict.send(Claim, identity=lost.identity)


def release(held: Held) -> bool:
    """Give up an unfinished claim so that a retry runs again.

    A completed result is never deleted, so a release in an ``except`` that
    also covers code after ``complete`` cannot cause a second run. False
    when the claim was completed, released or taken over.
    """
    return store.backend(held.using).release(held.identity, held.token)


def renew(held: Held, lease: float | None = None) -> bool:
    """Extend the lease of a long run; False if the claim was taken over.

    From inside the work's transaction (``once()``, ``@idempotent_task``)
    the new lease usually commits at once, through a connection of its own,
    so other workers see it and no row lock is held until the work commits;
    the store says when the work's own transaction must carry it instead
    (``renews_in_place``). A claim still inside the transaction that made it is invisible
    to others until that commits, so its lease needs no renewing (True).
    """
    seconds = held.policy.lease if lease is None else lease
    using = held.policy.using
    if held.uncommitted():
        return True
    records = store.backend(using)
    if not in_transaction(using):
        return records.renew(held.identity, held.token, seconds)
    if records.renews_in_place():
        try:
            return records.renew(held.identity, held.token, seconds)
        except DatabaseError as exc:
            if not is_lock_conflict(exc):
                raise
            # Taken over after the work's snapshot: the work must not commit.
            transaction.set_rollback(True, using=using)
            return False
    side = connections.create_connection(using)
    try:
        with work.by_the_library():  # not the work's: the guard lets it through
            return records.renew(held.identity, held.token, seconds, side)
    finally:
        side.close()
