"""The lifecycle without HTTP: takeover fencing, lock conflicts, bounded values."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError

from idempotency_app import clock, core, store
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity, StoredResponse

pytestmark = pytest.mark.django_db(transaction=True)

IDENTITY = Identity("scope", "key", "op", "f" * 64)
POLICY = core.Policy(ttl=3600, lease=1, wait=0, using="default")


def test_takeover_loses_to_a_completion_that_landed_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """B reads a lapsed claim; A completes before B's UPDATE: B must replay."""
    with clock.freeze():
        first = core.claim(IDENTITY, POLICY)
        assert isinstance(first, core.Claim)
        clock.advance(2)
        real_take_over = store.take_over

        def completion_lands_first(*args: Any, **kwargs: Any) -> bool:
            stored = StoredResponse(201, (), b"A")
            assert store.complete(IDENTITY, first.token, stored, clock.now(), 3600, "default")
            return real_take_over(*args, **kwargs)

        monkeypatch.setattr(store, "take_over", completion_lands_first)
        second = core.claim(IDENTITY, POLICY)
    assert isinstance(second, core.Replay)
    assert second.response.body == b"A"
    assert IdempotencyRecord.objects.get().status == "completed"


def test_takeover_loses_to_a_renewed_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    with clock.freeze():
        first = core.claim(IDENTITY, POLICY)
        assert isinstance(first, core.Claim)
        clock.advance(2)
        real_take_over = store.take_over

        def renewal_lands_first(*args: Any, **kwargs: Any) -> bool:
            assert store.renew(IDENTITY, first.token, clock.now(), 60, "default")
            return real_take_over(*args, **kwargs)

        monkeypatch.setattr(store, "take_over", renewal_lands_first)
        second = core.claim(IDENTITY, POLICY)
    assert isinstance(second, core.InProgress)
    assert IdempotencyRecord.objects.get().token == first.token


@pytest.mark.parametrize(
    "error",
    [
        OperationalError(1213, "Deadlock found when trying to get lock"),
        OperationalError(1205, "Lock wait timeout exceeded"),
        OperationalError("database is locked"),
    ],
    ids=["mysql-deadlock", "mysql-lock-wait", "sqlite-locked"],
)
def test_lock_conflicts_while_claiming_are_in_progress(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    def conflict(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(store, "insert_or_fetch", conflict)
    assert isinstance(core.claim(IDENTITY, POLICY), core.InProgress)


def test_other_database_errors_are_store_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(store, "insert_or_fetch", broken)
    with pytest.raises(core.StoreUnavailable):
        core.claim(IDENTITY, POLICY)


def test_work_that_marks_its_transaction_for_rollback_is_released() -> None:
    from django.db import transaction

    def work() -> str:
        transaction.set_rollback(True)
        return "value"

    result = core.run(IDENTITY, work, lambda value: StoredResponse(200, (), b"x"), POLICY)
    assert isinstance(result, core.Executed) and result.stored is None
    assert not IdempotencyRecord.objects.exists()
