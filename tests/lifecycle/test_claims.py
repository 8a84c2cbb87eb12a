"""The lifecycle without HTTP: takeover fencing, lock conflicts, bounded values."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.utils import timezone

from idempotency_app import clock, store
from idempotency_app.exceptions import KeyInProgress, StoreUnavailable, WorkRolledBack
from idempotency_app.lifecycle import units
from idempotency_app.lifecycle.claims import Claim, Policy, Replay, claim
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity, StoredResponse
from tests.conftest import end_session, session_id

pytestmark = pytest.mark.django_db(transaction=True)

IDENTITY = Identity("scope", "key", "op", "f" * 64)
POLICY = Policy(ttl=3600, lease=1, wait=0, using="default")


def test_takeover_loses_to_a_completion_that_landed_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """B reads a lapsed claim; A completes before B's UPDATE: B must replay."""
    with clock.freeze():
        first = claim(IDENTITY, POLICY)
        assert isinstance(first, Claim)
        clock.advance(2)
        records = store.backend("default")
        real_take_over = records.take_over

        def completion_lands_first(*args: Any, **kwargs: Any) -> bool:
            stored = StoredResponse(201, (), b"A")
            assert records.complete(IDENTITY, first.token, stored, 3600)
            return real_take_over(*args, **kwargs)

        monkeypatch.setattr(records, "take_over", completion_lands_first)
        second = claim(IDENTITY, POLICY)
    assert isinstance(second, Replay)
    assert second.response.body == b"A"
    assert IdempotencyRecord.objects.get().status == "completed"


def test_takeover_loses_to_a_renewed_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    with clock.freeze():
        first = claim(IDENTITY, POLICY)
        assert isinstance(first, Claim)
        clock.advance(2)
        records = store.backend("default")
        real_take_over = records.take_over

        def renewal_lands_first(*args: Any, **kwargs: Any) -> bool:
            assert records.renew(IDENTITY, first.token, 60)
            return real_take_over(*args, **kwargs)

        monkeypatch.setattr(records, "take_over", renewal_lands_first)
        with pytest.raises(KeyInProgress):
            claim(IDENTITY, POLICY)
    assert IdempotencyRecord.objects.get().token == first.token


@pytest.mark.parametrize(
    "error",
    [
        OperationalError(1213, "Deadlock found when trying to get lock"),
        OperationalError(1205, "Lock wait timeout exceeded"),
        OperationalError("database is locked"),
        OperationalError("database table is locked"),
    ],
    ids=["mysql-deadlock", "mysql-lock-wait", "sqlite-locked", "sqlite-shared-cache-locked"],
)
def test_lock_conflicts_while_claiming_are_in_progress(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    def conflict(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(store.backend("default"), "claim", conflict)
    with pytest.raises(KeyInProgress):
        claim(IDENTITY, POLICY)


def test_other_database_errors_are_store_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(store.backend("default"), "claim", broken)
    with pytest.raises(StoreUnavailable):
        claim(IDENTITY, POLICY)


def test_work_that_marks_its_transaction_for_rollback_is_released() -> None:
    from django.db import transaction

    def work() -> str:
        transaction.set_rollback(True)
        return "value"

    with pytest.raises(WorkRolledBack) as rolled_back:
        units.run(IDENTITY, work, lambda value: StoredResponse(200, (), b"x"), POLICY)
    assert rolled_back.value.value == "value", "a success whose work rolled back is not a success"
    assert not IdempotencyRecord.objects.exists()


def test_a_second_completion_never_overwrites_the_first() -> None:
    held = claim(IDENTITY, POLICY)
    assert isinstance(held, Claim)
    records = store.backend("default")
    assert records.complete(IDENTITY, held.token, StoredResponse(201, (), b"first"), 3600)
    assert not records.complete(IDENTITY, held.token, StoredResponse(200, (), b"second"), 3600)
    assert bytes(IdempotencyRecord.objects.get().response_body) == b"first"


def test_leases_are_judged_by_the_database_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """An app server whose clock runs an hour ahead must not take over a
    claim whose lease is live by the database's clock."""
    policy = Policy(ttl=3600, lease=60, wait=0, using="default")
    first = claim(IDENTITY, policy)
    assert isinstance(first, Claim)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + timedelta(hours=1))
    with pytest.raises(KeyInProgress):
        claim(IDENTITY, policy)
    assert IdempotencyRecord.objects.get().token == first.token


@contextlib.contextmanager
def database_down(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The default database refusing connections, for real: nothing listens
    on port 1. An in-memory SQLite database cannot go away."""
    if connection.vendor == "sqlite":
        pytest.skip("an in-memory SQLite database cannot refuse connections")
    connection.close()
    with monkeypatch.context() as patch:
        patch.setitem(connection.settings_dict, "PORT", "1")
        patch.setitem(connection.settings_dict, "HOST", "127.0.0.1")
        yield
        connection.close()


def test_a_database_that_refuses_connections_is_store_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with database_down(monkeypatch), pytest.raises(StoreUnavailable):
        claim(IDENTITY, POLICY)
    assert isinstance(claim(IDENTITY, POLICY), Claim), "back once it is reachable"


def test_a_connection_broken_since_its_last_use_is_replaced_once() -> None:
    if connection.vendor == "sqlite":
        pytest.skip("needs a database server that can end a session")
    end_session(session_id())
    assert isinstance(claim(IDENTITY, POLICY), Claim)


def test_an_outage_at_the_completion_is_signalled_once_the_work_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from idempotency_app import signals

    def lost(*args: Any, **kwargs: Any) -> bool:
        raise OperationalError("server closed the connection unexpectedly")

    seen: list[bool] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(connection.in_atomic_block)

    monkeypatch.setattr(store.backend("default"), "complete", lost)
    signals.store_unavailable.connect(receiver, dispatch_uid="test-outage")
    try:
        with pytest.raises(StoreUnavailable):
            units.run(IDENTITY, lambda: "x", lambda value: StoredResponse(200, (), b"x"), POLICY)
    finally:
        signals.store_unavailable.disconnect(dispatch_uid="test-outage")
    assert seen == [False], "sent once, outside the work's transaction"
