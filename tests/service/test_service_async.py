"""The service API from async code: aonce(), async functions under
@idempotent_task, and the async by-hand calls. Each test drives its
coroutine with async_to_sync, as Django's own async tests do, so the
coroutine's async ORM calls come back to the test's thread and database."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection
from django.test.utils import override_settings

from idempotency_app import service
from idempotency_app.exceptions import CannotBeAtomic
from idempotency_app.models import IdempotencyRecord
from tests.testapp.models import AuditEntry, Charge, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])

SCOPE = "queue:async"
OP = "tests.async_event"
T = TypeVar("T")


def run(coroutine_function: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await coroutine_function()

    return async_to_sync(main)()


async def acharge(label: str, amount: int = 1) -> dict[str, Any]:
    row = await Charge.objects.acreate(label=label, amount=amount)
    await LedgerEntry.objects.acreate(charge=row, amount=amount)
    return {"charge": row.pk, "label": label}


async def adeliver(key: str, label: str = "a", **options: Any) -> service.Run:
    async with service.aonce(SCOPE, key, OP, **options) as run:
        if run.should_execute:
            run.result = await acharge(label)
    return run


# -- aonce() -----------------------------------------------------------------


def test_aonce_runs_once_and_replays_the_stored_result() -> None:
    first = run(lambda: adeliver("evt_1"))
    second = run(lambda: adeliver("evt_1", label="other"))
    assert first.should_execute and not first.replayed
    assert second.replayed and second.result == first.result
    assert first.result["label"] == "a"
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == "completed"


def test_aonce_block_writes_commit_with_the_result_or_not_at_all() -> None:
    async def unstorable() -> None:
        async with service.aonce(SCOPE, "evt_2", OP) as run:
            await acharge("x")
            run.result = {"when": object()}

    with pytest.raises(TypeError, match="object"):
        run(unstorable)
    # The writes ran in the unit's transaction: they rolled back with it.
    assert Charge.objects.count() == 0 and LedgerEntry.objects.count() == 0
    assert not IdempotencyRecord.objects.exists(), "the claim was released"
    assert run(lambda: adeliver("evt_2")).should_execute


def test_aonce_exception_releases_the_claim_and_rolls_back() -> None:
    class Boom(Exception):
        pass

    async def failing() -> None:
        async with service.aonce(SCOPE, "evt_3", OP):
            await acharge("x")
            raise Boom

    with pytest.raises(Boom):
        run(failing)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


def test_aonce_duplicate_in_progress_raises_before_the_block() -> None:
    held = service.claim(SCOPE, "evt_4", OP)
    assert isinstance(held, service.Held)
    entered = []

    async def duplicate() -> None:
        async with service.aonce(SCOPE, "evt_4", OP):
            entered.append(True)

    with pytest.raises(service.KeyInProgress):
        run(duplicate)
    assert entered == []


def test_aonce_rejects_a_bad_key_before_touching_the_database() -> None:
    async def bad() -> None:
        async with service.aonce(SCOPE, "", OP):
            pass

    with pytest.raises(ValueError, match="must not be empty"):
        run(bad)


def test_aonce_nested_for_the_same_key_is_part_of_the_same_run() -> None:
    async def nested() -> Any:
        async with service.aonce(SCOPE, "evt_5", OP) as outer:
            async with service.aonce(SCOPE, "evt_5", OP) as inner:
                assert inner.should_execute, "not a duplicate of its own run"
                inner.result = await acharge("inner")
            outer.result = inner.result
        return outer.result

    result = run(nested)
    assert result["label"] == "inner"
    assert Charge.objects.count() == 1


def test_aonce_refuses_a_write_to_another_database() -> None:
    async def writes_elsewhere() -> None:
        async with service.aonce(SCOPE, "evt_6", OP) as run:
            await AuditEntry.objects.using("other").acreate(note="x")
            run.result = 1

    with pytest.raises(CannotBeAtomic):
        run(writes_elsewhere)
    assert not IdempotencyRecord.objects.exists()


def test_gathered_blocks_do_not_share_a_transaction() -> None:
    """Two blocks of one task, gathered: they take turns on the context's
    connection, so the failing one rolls back only its own writes."""

    async def failing() -> None:
        async with service.aonce(SCOPE, "evt_fail", OP):
            await acharge("fails")
            await asyncio.sleep(0.05)  # the other block would start here if it could
            raise RuntimeError("boom")

    async def both() -> list[Any]:
        return await asyncio.gather(adeliver("evt_ok", "ok"), failing(), return_exceptions=True)

    outcomes = run(both)
    assert isinstance(outcomes[0], service.Run) and outcomes[0].should_execute
    assert isinstance(outcomes[1], RuntimeError)
    assert list(Charge.objects.values_list("label", flat=True)) == ["ok"]
    assert IdempotencyRecord.objects.get().key == "evt_ok"


def test_a_cancelled_block_releases_its_claim_and_rolls_back() -> None:
    started = asyncio.Event()

    async def slow() -> None:
        async with service.aonce(SCOPE, "evt_7", OP) as run:
            await acharge("cancelled")
            started.set()
            await asyncio.sleep(30)
            run.result = 1

    async def cancel_it() -> None:
        task = asyncio.ensure_future(slow())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_it)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()
    assert run(lambda: adeliver("evt_7")).should_execute


def test_a_block_renews_its_lease() -> None:
    async def long_run() -> Any:
        async with service.aonce(SCOPE, "evt_9", OP, lease=5) as run:
            before = await IdempotencyRecord.objects.values_list("locked_until", flat=True).aget()
            assert await run.arenew(600) is True
            after = await IdempotencyRecord.objects.values_list("locked_until", flat=True).aget()
            run.result = (after - before).total_seconds()
        return run.result

    assert run(long_run) > 500


def test_aonce_passes_through_when_disabled() -> None:
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        run(lambda: adeliver("evt_8"))
        run(lambda: adeliver("evt_8"))
    assert Charge.objects.count() == 2
    assert not IdempotencyRecord.objects.exists()


# -- @idempotent_task on async functions --------------------------------------


calls: list[str] = []


@service.idempotent_task(key=lambda event: event["id"], scope=SCOPE)
async def handle_event(event: dict[str, Any]) -> dict[str, Any]:
    calls.append(event["id"])
    result = await acharge(event["label"])
    if event.get("fail"):
        raise RuntimeError("the handler failed")
    in_unit = await sync_to_async(lambda: connection.in_atomic_block)()
    return {**result, "in_transaction": in_unit}


def test_async_task_stays_a_coroutine_function_and_runs_once() -> None:
    assert asyncio.iscoroutinefunction(handle_event)
    calls.clear()
    first = run(lambda: handle_event({"id": "e1", "label": "a"}))
    second = run(lambda: handle_event({"id": "e1", "label": "a"}))
    assert calls == ["e1"]
    assert first == second
    assert first["in_transaction"] is True, "the coroutine's queries ran in the unit's transaction"
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1


def test_async_task_failure_rolls_back_and_releases() -> None:
    calls.clear()
    with pytest.raises(RuntimeError, match="handler failed"):
        run(lambda: handle_event({"id": "e2", "label": "a", "fail": True}))
    assert Charge.objects.count() == 0, "its writes were in the unit's transaction"
    run(lambda: handle_event({"id": "e2", "label": "a"}))
    assert calls == ["e2", "e2"]
    assert Charge.objects.count() == 1


def test_async_task_unstorable_result_names_the_problem() -> None:
    @service.idempotent_task(key=lambda n: n, scope=SCOPE, operation="tests.decimal")
    async def returns_a_set(n: int) -> Any:
        await Charge.objects.acreate(label="set")
        return {1, 2}

    with pytest.raises(TypeError, match="result is a set"):
        run(lambda: returns_a_set(1))
    assert Charge.objects.count() == 0


def test_async_task_duplicate_in_progress_raises_key_in_progress() -> None:
    service.claim(SCOPE, "e3", handle_event.__module__ + ".handle_event")
    with pytest.raises(service.KeyInProgress):
        run(lambda: handle_event({"id": "e3", "label": "a"}))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_generators_are_refused_when_decorated(kind: str) -> None:
    decorate = service.idempotent_task(key=lambda n: n, scope=SCOPE)
    if kind == "sync":

        def numbers(n: int) -> Any:
            yield n

        target: Any = numbers
    else:

        async def anumbers(n: int) -> Any:
            yield n

        target = anumbers
    with pytest.raises(TypeError, match=r"cannot wrap the generator .* Return a list"):
        decorate(target)


# -- by hand -----------------------------------------------------------------


def test_async_by_hand_claim_complete_release_renew() -> None:
    async def flow() -> tuple[Any, ...]:
        held = await service.aclaim(SCOPE, "h1", OP, lease=30)
        assert isinstance(held, service.Held)
        renewed = await service.arenew(held, 60)
        stored = await service.acomplete(held, {"n": (1, 2)})
        again = await service.aclaim(SCOPE, "h1", OP)
        other = await service.aclaim(SCOPE, "h2", OP)
        assert isinstance(other, service.Held)
        released = await service.arelease(other)
        found = await service.alookup_many(SCOPE, ["h1", "h2"])
        one = await service.alookup(SCOPE, "h1")
        return renewed, stored, again, released, found, one

    renewed, stored, again, released, found, one = run(flow)
    assert renewed is True
    assert stored == {"n": [1, 2]}
    assert again == service.Done({"n": [1, 2]})
    assert released is True
    assert set(found) == {"h1"} and found["h1"].completed
    assert one is not None and one.result == {"n": [1, 2]}


def test_acomplete_inside_a_block_commits_with_it() -> None:
    async def flow() -> None:
        held = await service.aclaim(SCOPE, "h3", OP)
        assert isinstance(held, service.Held)
        async with service.aonce(SCOPE, "outer", OP) as run:
            await service.acomplete(held, "done")
            run.result = 1
            raise RuntimeError("the block fails after completing h3")

    with pytest.raises(RuntimeError):
        run(flow)
    record = IdempotencyRecord.objects.get(key="h3")
    assert record.status == "in_progress", "h3's completion rolled back with the block"
    assert connection.in_atomic_block is False
