"""The service API for tasks, webhooks and consumers: once(), @idempotent_task,
the hand-driven functions, batch lookup and completion, derived keys."""

from __future__ import annotations

import contextlib
import contextvars
import json
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

from idempotency_app import clock, service
from idempotency_app.models import IdempotencyRecord
from tests.concurrency import in_threads
from tests.conftest import needs_server_db
from tests.testapp.models import Charge, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)

SCOPE = "webhooks:test"
OP = "tests.handle_event"
LEASE = 30
TTL = 3600


def charge(label: str, amount: int = 1) -> dict[str, Any]:
    """The work under test: two writes, so a partial run shows as a lone Charge."""
    row = Charge.objects.create(label=label, amount=amount)
    LedgerEntry.objects.create(charge=row, amount=amount)
    return {"charge": row.pk, "label": label}


def deliver(key: str, label: str = "a", **options: Any) -> service.Run:
    with service.once(SCOPE, key, OP, **options) as run:
        if run.should_execute:
            run.result = charge(label)
    return run


def record() -> IdempotencyRecord:
    return IdempotencyRecord.objects.get()


def hold(key: str, operation: str = OP, **options: Any) -> service.Held:
    """Claim ``key`` by hand, as a worker that has not finished would."""
    held = service.claim(SCOPE, key, operation, **options)
    assert isinstance(held, service.Held)
    return held


# -- once() ------------------------------------------------------------------


def test_once_runs_the_block_once_and_every_copy_gets_the_result() -> None:
    runs = [deliver("evt_1") for _ in range(10)]
    assert [r.replayed for r in runs] == [False] + [True] * 9
    assert all(r.result == runs[0].result for r in runs)
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
    stored = record()
    assert (stored.status, stored.response_status) == ("completed", None), "a result, no status"
    assert json.loads(stored.response_headers) == []
    assert json.loads(bytes(stored.response_body or b"")) == runs[0].result


def test_a_result_stored_as_a_json_response_still_reads_back() -> None:
    """Before 0.2 a result was stored as a 200 with Content-Type JSON; rows
    stored so, within their TTL, replay their result after the upgrade."""
    deliver("evt_1")
    IdempotencyRecord.objects.update(
        response_status=200, response_headers='[["Content-Type","application/json"]]'
    )
    again = deliver("evt_1")
    assert again.replayed and again.result == json.loads(bytes(record().response_body or b""))
    assert service.lookup(SCOPE, "evt_1").result == again.result


def test_keys_and_scopes_are_separate() -> None:
    deliver("evt_1")
    deliver("evt_2")
    with service.once("webhooks:other", "evt_1", OP) as run:
        assert run.should_execute
        run.result = charge("other")
    assert Charge.objects.count() == 3
    assert IdempotencyRecord.objects.count() == 3


def test_exception_in_the_block_releases_and_rolls_back() -> None:
    with pytest.raises(RuntimeError, match="boom"), service.once(SCOPE, "evt_1", OP) as run:
        charge("a")
        raise RuntimeError("boom")
    assert run.should_execute
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0, "the block's writes roll back with the release"
    assert not deliver("evt_1").replayed
    assert Charge.objects.count() == 1


def test_the_result_of_a_replayed_run_cannot_be_overwritten() -> None:
    deliver("evt_1")
    with (
        pytest.raises(RuntimeError, match="should_execute"),
        service.once(SCOPE, "evt_1", OP) as run,
    ):
        run.result = "again"
    assert record().status == "completed"


def test_a_block_that_sets_no_result_stores_null() -> None:
    with service.once(SCOPE, "evt_1", OP) as run:
        charge("a")
    assert run.result is None
    again = deliver("evt_1")
    assert again.replayed and again.result is None
    assert Charge.objects.count() == 1


def test_nested_mode_commits_and_rolls_back_with_the_outer_transaction() -> None:
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        assert deliver("evt_1").should_execute
        raise Abort
    assert not IdempotencyRecord.objects.exists() and Charge.objects.count() == 0
    with transaction.atomic():
        first = deliver("evt_1")
        second = deliver("evt_1")
    assert first.should_execute and second.replayed and second.result == first.result
    assert Charge.objects.count() == 1 and record().status == "completed"


def test_disabled_is_a_pass_through() -> None:
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        runs = [deliver("evt_1"), deliver("evt_1")]
    assert [r.should_execute for r in runs] == [True, True]
    assert Charge.objects.count() == 2
    assert not IdempotencyRecord.objects.exists()


# -- @idempotent_task ----------------------------------------------------------


def make_handler(calls: list[str], **options: Any) -> Callable[..., Any]:
    @service.idempotent_task(key=lambda event: event["id"], scope=SCOPE, **options)
    def handle(event: dict[str, Any]) -> dict[str, Any]:
        calls.append(event["id"])
        if event.get("fail"):
            charge("partial")
            raise ValueError("handler failed")
        return charge(event.get("label", "a"))

    return handle


def test_decorator_runs_once_per_event_and_returns_the_stored_result() -> None:
    calls: list[str] = []
    handle = make_handler(calls)
    results = [handle({"id": "evt_1"}) for _ in range(10)]
    results.append(handle({"id": "evt_2"}))
    assert calls == ["evt_1", "evt_2"]
    assert all(r == results[0] for r in results[:10])
    assert results[10] != results[0]
    assert Charge.objects.count() == 2
    stored = IdempotencyRecord.objects.get(key="evt_1")
    assert stored.operation == f"{__name__}.make_handler.<locals>.handle"
    assert stored.scope == SCOPE


def test_decorator_scope_and_operation_from_the_call() -> None:
    @service.idempotent_task(
        key=lambda provider, event_id: event_id,
        scope=lambda provider, event_id: f"provider:{provider}",
        operation="payout",
    )
    def handle(provider: str, event_id: int) -> str:
        return f"{provider}:{event_id}"

    assert handle("acme", 7) == "acme:7"
    assert handle("zeta", 7) == "zeta:7"
    assert handle("acme", 7) == "acme:7"
    assert sorted(IdempotencyRecord.objects.values_list("scope", "key", "operation")) == [
        ("provider:acme", "7", "payout"),
        ("provider:zeta", "7", "payout"),
    ]
    assert handle.identify("acme", 7).key == "7"  # type: ignore[attr-defined]


def test_decorator_exception_releases_and_rolls_back() -> None:
    calls: list[str] = []
    handle = make_handler(calls)
    with pytest.raises(ValueError, match="handler failed"):
        handle({"id": "evt_1", "fail": True})
    assert not IdempotencyRecord.objects.exists() and Charge.objects.count() == 0
    handle({"id": "evt_1"})
    assert calls == ["evt_1", "evt_1"] and Charge.objects.count() == 1


def test_decorator_first_caller_also_gets_the_json_round_trip() -> None:
    @service.idempotent_task(key=lambda n: n, scope=SCOPE)
    def handle(n: int) -> Any:
        return (n, {"n": n})

    assert handle(1) == [1, {"n": 1}]
    assert handle(1) == [1, {"n": 1}]


def test_once_hands_the_first_run_the_stored_form_too() -> None:
    with service.once(SCOPE, "evt_1", OP) as run:
        run.result = {"b": (1, 2), "a": None}
    assert run.result == {"a": None, "b": [1, 2]}
    assert json.dumps(run.result) == json.dumps(deliver("evt_1").result)


def test_fingerprint_catches_a_reused_event_id() -> None:
    calls: list[str] = []
    handle = make_handler(calls, fingerprint=lambda event: event)
    handle({"id": "evt_1", "label": "a"})
    handle({"id": "evt_1", "label": "a"})
    with pytest.raises(service.KeyReused, match="evt_1"):
        handle({"id": "evt_1", "label": "b"})
    assert calls == ["evt_1"]


def test_another_operation_on_the_same_key_is_refused() -> None:
    deliver("evt_1")
    with pytest.raises(service.KeyReused), service.once(SCOPE, "evt_1", "another.operation"):
        pytest.fail("the block must not run")


def test_disabled_decorator_calls_through() -> None:
    calls: list[str] = []
    handle = make_handler(calls)
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        handle({"id": "evt_1"})
        handle({"id": "evt_1"})
    assert calls == ["evt_1", "evt_1"] and not IdempotencyRecord.objects.exists()


# -- JSON results ----------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(2**70),
        1.5,
        'caf\u00e9 \U0001f600 "quoted" \\',
        [],
        {"nested": {"list": [1, "two", None, False, 2.25]}, "empty": {}},
    ],
    ids=["null", "bool", "zero", "bigint", "float", "unicode", "empty-list", "nested"],
)
def test_json_round_trip(value: Any) -> None:
    with service.once(SCOPE, "evt_1", OP) as run:
        run.result = value
    assert deliver("evt_1").result == value
    entry = service.lookup(SCOPE, "evt_1")
    assert entry is not None and entry.result == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (Decimal("1.10"), r"result\['amount'\] is a Decimal"),
        ({"at": datetime(2026, 1, 1, tzinfo=timezone.utc)}, "is a datetime"),
        ({"ids": {1, 2}}, "is a set"),
        ([object()], r"result\[0\] is a object"),
        ({"x": float("nan")}, "NaN"),
        ({1: "one"}, "keys must be strings"),
    ],
    ids=["decimal", "datetime", "set", "object", "nan", "int-key"],
)
def test_a_result_json_cannot_hold_rolls_back_and_releases(value: Any, message: str) -> None:
    if isinstance(value, Decimal):
        value = {"amount": value}
    with pytest.raises(TypeError, match=message), service.once(SCOPE, "evt_1", OP) as run:
        charge("a")
        run.result = value
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0
    assert deliver("evt_1").should_execute, "a retry that returns JSON runs"


def test_decorator_with_an_unserialisable_result_releases() -> None:
    @service.idempotent_task(key=lambda n: n, scope=SCOPE)
    def handle(n: int) -> Any:
        charge("a")
        return Decimal(n)

    with pytest.raises(TypeError, match="is a Decimal"):
        handle(1)
    assert not IdempotencyRecord.objects.exists() and Charge.objects.count() == 0


def test_an_unserialisable_fingerprint_fails_before_any_work() -> None:
    calls: list[str] = []
    handle = make_handler(calls, fingerprint=lambda event: Decimal(1))
    with (
        CaptureQueriesContext(connection) as queries,
        pytest.raises(TypeError, match="fingerprint"),
    ):
        handle({"id": "evt_1"})
    assert calls == [] and len(queries) == 0


@pytest.mark.parametrize(
    ("key", "error"),
    [
        ("", ValueError),
        (None, TypeError),
        ("k" * 256, ValueError),
        (True, TypeError),
        ("evt\x00", ValueError),
        ("evt\udcc3", ValueError),
    ],
    ids=["empty", "none", "too-long", "bool", "nul", "lone-surrogate"],
)
def test_bad_keys_fail_before_any_query(key: Any, error: type[Exception]) -> None:
    with CaptureQueriesContext(connection) as queries, pytest.raises(error):
        deliver(key)
    assert len(queries) == 0


def test_an_operation_with_nul_fails_before_any_query() -> None:
    with CaptureQueriesContext(connection) as queries, pytest.raises(ValueError, match="NUL"):
        service.claim(SCOPE, "evt_1", "tests.\x00")
    assert len(queries) == 0


def test_an_oversized_result_is_refused() -> None:
    with (
        override_settings(IDEMPOTENCY={"MAX_BODY_BYTES": 16}),
        pytest.raises(ValueError, match="MAX_BODY_BYTES"),
        service.once(SCOPE, "k", OP) as run,
    ):
        charge("a")
        run.result = "x" * 20
    assert not IdempotencyRecord.objects.exists() and Charge.objects.count() == 0


# -- by hand, leases and TTL ---------------------------------------------------


def test_hand_driven_lifecycle() -> None:
    held = hold("evt_1")
    with transaction.atomic():
        service.complete(held, charge("a"))
    done = service.claim(SCOPE, "evt_1", OP)
    assert isinstance(done, service.Done) and done.result["label"] == "a"
    assert not service.release(held), "a completed result is never released"
    assert record().status == "completed"


def test_release_lets_the_next_delivery_run() -> None:
    held = hold("evt_1")
    assert service.release(held)
    assert not service.release(held)
    assert deliver("evt_1").should_execute


def test_a_duplicate_of_work_in_progress_raises_key_in_progress() -> None:
    calls: list[str] = []
    handle = make_handler(calls)
    hold("evt_1", f"{__name__}.make_handler.<locals>.handle")
    with pytest.raises(service.KeyInProgress) as caught:
        handle({"id": "evt_1"})
    assert caught.value.retry_after >= 1 and "evt_1" in str(caught.value)
    assert calls == []


def test_lease_expiry_takeover_and_fencing() -> None:
    with clock.freeze():
        crashed = hold("evt_1", lease=LEASE)
        clock.advance(LEASE - 1)
        with pytest.raises(service.KeyInProgress):
            deliver("evt_1")
        clock.advance(2)
        second = deliver("evt_1", label="second")
        assert second.should_execute
        with pytest.raises(service.ClaimLost), transaction.atomic():
            charge("late")
            service.complete(crashed, {"label": "late"})
    assert list(Charge.objects.values_list("label", flat=True)) == ["second"]
    assert deliver("evt_1").result == second.result
    assert not service.release(crashed)


def test_renew_keeps_a_long_run_from_being_taken_over() -> None:
    with clock.freeze():
        held = hold("evt_1", lease=LEASE)
        clock.advance(LEASE - 5)
        assert service.renew(held)
        clock.advance(LEASE - 5)
        with pytest.raises(service.KeyInProgress):
            service.claim(SCOPE, "evt_1", OP)
        clock.advance(10)
        hold("evt_1")
        assert not service.renew(held), "a claim taken over cannot be renewed"


def test_ttl_expiry_runs_the_work_again() -> None:
    with clock.freeze():
        deliver("evt_1", ttl=TTL)
        clock.advance(TTL - 1)
        assert deliver("evt_1", ttl=TTL).replayed
        assert service.lookup(SCOPE, "evt_1") is not None
        clock.advance(2)
        assert service.lookup(SCOPE, "evt_1") is None
        assert deliver("evt_1", ttl=TTL).should_execute
    assert Charge.objects.count() == 2 and IdempotencyRecord.objects.count() == 1


# -- batches ---------------------------------------------------------------------


def test_lookup_many_answers_in_one_query() -> None:
    with clock.freeze():
        for n in range(10):
            with service.once(SCOPE, f"done-{n}", OP) as run:
                run.result = {"n": n}
        for n in range(5):
            hold(f"busy-{n}", lease=LEASE)
        for n in range(3):
            with service.once(SCOPE, f"old-{n}", OP, ttl=60) as run:
                run.result = n
        with service.once("webhooks:other", "done-0", OP) as run:
            run.result = "other scope"
        clock.advance(61)
        wanted = [f"{kind}-{n}" for kind in ("done", "busy", "old", "never") for n in range(10)]
        with CaptureQueriesContext(connection) as queries:
            found = service.lookup_many(SCOPE, wanted)
        assert len(queries) == 1
        assert sorted(found) == sorted(
            [f"done-{n}" for n in range(10)] + [f"busy-{n}" for n in range(5)]
        )
        assert all(
            found[f"done-{n}"].completed and found[f"done-{n}"].result == {"n": n}
            for n in range(10)
        )
        assert not found["busy-0"].completed and found["busy-0"].result is None
        assert found["busy-0"].locked_until is not None


def test_complete_many_completes_a_batch_with_its_work() -> None:
    helds = [hold(f"evt_{n}") for n in range(3)]
    with transaction.atomic():
        service.complete_many((h, charge(h.key)) for h in helds)
    found = service.lookup_many(SCOPE, [f"evt_{n}" for n in range(3)])
    assert [found[f"evt_{n}"].result["label"] for n in range(3)] == ["evt_0", "evt_1", "evt_2"]


def test_complete_many_is_all_or_nothing_when_a_claim_was_lost() -> None:
    with clock.freeze():
        helds = [hold(f"evt_{n}", lease=LEASE) for n in range(3)]
        clock.advance(LEASE + 1)
        hold("evt_1")
        with pytest.raises(service.ClaimLost, match="evt_1"), transaction.atomic():
            service.complete_many((h, charge(h.key)) for h in helds)
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.filter(status="completed").exists()


def test_complete_many_validates_every_result_before_writing() -> None:
    helds = [hold(f"evt_{n}") for n in range(2)]
    with pytest.raises(TypeError, match="is a set"):
        service.complete_many([(helds[0], "fine"), (helds[1], {1, 2})])
    assert not IdempotencyRecord.objects.filter(status="completed").exists()


# -- derived keys ----------------------------------------------------------------


def test_derive_key_is_stable_and_distinct() -> None:
    key = service.derive_key("provider:acme", "evt_1", "charge-card")
    # Pinned: keys already sent to providers depend on this exact value.
    assert key == "0fbf1ac7be6f8e89b8b8a9fec8d5637541ae05dc70dcfd80b134184b8bc493f6"
    assert service.derive_key("provider:acme", "evt_1", "refund") != key
    assert service.derive_key("provider:acme", "evt_2", "charge-card") != key
    assert service.derive_key("a", "bc", "d") != service.derive_key("ab", "c", "d")


def test_a_retried_run_derives_the_same_downstream_key() -> None:
    sent: list[str] = []
    with pytest.raises(ConnectionError), service.once(SCOPE, "evt_1", OP) as run:
        sent.append(run.derive_key("provider-charge"))
        raise ConnectionError("provider timed out after accepting")
    with service.once(SCOPE, "evt_1", OP) as run:
        sent.append(run.derive_key("provider-charge"))
        run.result = "charged"
    assert sent[0] == sent[1] == service.derive_key(SCOPE, "evt_1", "provider-charge")


# -- backends --------------------------------------------------------------------


def test_keys_that_differ_only_in_case_are_different_events() -> None:
    first = deliver("evt_AbC")
    second = deliver("evt_aBc")
    assert first.should_execute and second.should_execute
    assert Charge.objects.count() == 2


# -- concurrency: threads and processes -------------------------------------------


def slow_handler(calls: list[str], **options: Any) -> Callable[..., Any]:
    @service.idempotent_task(key=lambda event: event["id"], scope=SCOPE, operation=OP, **options)
    def handle(event: dict[str, Any]) -> dict[str, Any]:
        calls.append(event["id"])
        row = Charge.objects.create(label="a", amount=1)
        # Long enough that every thread of a test meets the claim in progress,
        # even on a loaded machine.
        threading.Event().wait(1)
        LedgerEntry.objects.create(charge=row, amount=1)
        return {"charge": row.pk}

    return handle


@needs_server_db
def test_ten_concurrent_deliveries_in_threads_run_once() -> None:
    calls: list[str] = []
    handle = slow_handler(calls, wait=30)
    results = in_threads(10, lambda: handle({"id": "evt_1"}))
    assert calls == ["evt_1"]
    assert all(r == results[0] for r in results), results
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1


@needs_server_db
def test_concurrent_duplicates_without_waiting_are_told_to_retry() -> None:
    calls: list[str] = []
    handle = slow_handler(calls, wait=0)
    results = in_threads(6, lambda: handle({"id": "evt_1"}))
    busy = [r for r in results if isinstance(r, service.KeyInProgress)]
    done = [r for r in results if isinstance(r, dict)]
    assert (len(done), len(busy)) == (1, 5), results
    assert handle({"id": "evt_1"}) == done[0], "a retry gets the first result"
    assert calls == ["evt_1"]


def claim_with_a_short_lock_wait(wait: float) -> service.Held | service.Done:
    """Claim on a connection that gives up on a row lock within a second,
    as a busy server's deadlock detector or lock timeout would."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET lock_timeout = '100ms'")
        else:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
    return service.claim(SCOPE, "evt_1", OP, wait=wait)


# Well beyond MariaDB's shortest lock wait (1 s), so that a duplicate started
# late on a loaded machine still meets the held row rather than its absence.
HOLD_SECONDS = 3.5


def holding_an_uncommitted_claim(seconds: float) -> threading.Thread:
    """A thread whose transaction inserted the key's row, holds it for
    ``seconds`` (a duplicate's INSERT waits on it) and then rolls back."""
    holding = threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                service.claim(SCOPE, "evt_1", OP)
                holding.set()
                threading.Event().wait(seconds)
                transaction.set_rollback(True)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(10)
    return thread


@needs_server_db
def test_a_lock_timeout_while_claiming_is_retried_within_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    thread = holding_an_uncommitted_claim(HOLD_SECONDS)
    with caplog.at_level("INFO", logger="idempotency_app"):
        [outcome] = in_threads(1, lambda: claim_with_a_short_lock_wait(wait=10))
    thread.join(10)
    assert "Lock conflict claiming idempotency key 'evt_1'" in caplog.text
    assert isinstance(outcome, service.Held), outcome
    assert record().status == "in_progress"


@needs_server_db
def test_a_lock_timeout_in_a_hand_managed_transaction_is_not_retried() -> None:
    """With autocommit off, the server may have rolled back the caller's
    earlier work with the failed statement: answer at once, let them decide."""
    thread = holding_an_uncommitted_claim(HOLD_SECONDS)

    def claim_without_autocommit() -> Any:
        transaction.set_autocommit(False)
        try:
            return claim_with_a_short_lock_wait(wait=10)
        finally:
            transaction.rollback()
            transaction.set_autocommit(True)

    [outcome] = in_threads(1, claim_without_autocommit)
    thread.join(10)
    assert isinstance(outcome, service.KeyInProgress), outcome


@needs_server_db
def test_a_lock_timeout_without_a_wait_is_a_conflict() -> None:
    thread = holding_an_uncommitted_claim(HOLD_SECONDS)
    [outcome] = in_threads(1, lambda: claim_with_a_short_lock_wait(wait=0))
    thread.join(10)
    assert isinstance(outcome, service.KeyInProgress), outcome
    assert not IdempotencyRecord.objects.exists(), "the holder rolled back"


@needs_server_db
def test_a_worker_whose_claim_was_taken_over_rolls_back() -> None:
    inside, finish = threading.Event(), threading.Event()
    outcome: list[BaseException] = []

    def slow_worker() -> None:
        try:
            with service.once(SCOPE, "evt_1", OP, lease=LEASE) as run:
                charge("slow")
                inside.set()
                finish.wait(10)
                run.result = "slow"
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    with clock.freeze():
        thread = threading.Thread(target=slow_worker)
        thread.start()
        assert inside.wait(10)
        clock.advance(LEASE + 1)
        second = deliver("evt_1", label="fast")
        finish.set()
        thread.join(10)
    assert second.should_execute
    assert len(outcome) == 1 and isinstance(outcome[0], service.ClaimLost), outcome
    assert list(Charge.objects.values_list("label", flat=True)) == ["fast"]
    assert LedgerEntry.objects.count() == 1
    assert deliver("evt_1").result == second.result


def _deliver_in_child(key: str, results: Any) -> None:
    connections.close_all()
    try:
        handle = slow_handler([], wait=30)
        results.put(handle({"id": key}))
    except Exception as exc:
        results.put(repr(exc))
    finally:
        connections.close_all()


def fork() -> Any:
    # Close the parent's connections first: a child that closed an inherited
    # one would end the parent's session on the server.
    connections.close_all()
    return multiprocessing.get_context("fork")


@needs_server_db
@pytest.mark.slow
def test_ten_deliveries_from_processes_run_once() -> None:
    context = fork()
    results = context.Queue()
    children = [
        context.Process(target=_deliver_in_child, args=("evt_1", results)) for _ in range(5)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=30) for _ in children]
    for child in children:
        child.join(10)
    calls: list[str] = []
    handle = slow_handler(calls)
    outcomes += [handle({"id": "evt_1"}) for _ in range(5)]
    assert calls == [], "the parent's copies all replay"
    assert all(o == outcomes[0] for o in outcomes), outcomes
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1


def _die_inside_the_block(key: str, inside: Any) -> None:
    connections.close_all()
    with service.once(SCOPE, key, OP, lease=LEASE) as run:
        Charge.objects.create(label="partial", amount=1)
        inside.set()
        threading.Event().wait(60)
        run.result = "never"


@needs_server_db
@pytest.mark.slow
def test_a_killed_worker_leaves_no_partial_rows_and_runs_once_after_the_lease() -> None:
    with clock.freeze():
        context = fork()
        inside = context.Event()
        child = context.Process(target=_die_inside_the_block, args=("evt_1", inside))
        child.start()
        assert inside.wait(30)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL
        assert Charge.objects.count() == 0, "the partial write died with its transaction"
        assert record().status == "in_progress"
        with pytest.raises(service.KeyInProgress):
            deliver("evt_1")
        clock.advance(LEASE + 1)
        runs = [deliver("evt_1") for _ in range(3)]
    assert [r.should_execute for r in runs] == [True, False, False]
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
    assert record().status == "completed"


# -- no success without committed work ----------------------------------------


def test_a_block_that_marks_its_transaction_for_rollback_is_not_stored() -> None:
    with (
        pytest.raises(service.WorkRolledBack, match="rolled back"),
        service.once(SCOPE, "evt_1", OP) as run,
    ):
        run.result = charge("doomed")
        transaction.set_rollback(True)
    assert (Charge.objects.count(), IdempotencyRecord.objects.count()) == (0, 0)
    assert deliver("evt_1").should_execute, "released: the next delivery runs"


def test_a_task_that_marks_its_transaction_for_rollback_raises() -> None:
    @service.idempotent_task(key=lambda event: event["id"], scope=SCOPE)
    def handle(event: dict[str, Any]) -> dict[str, Any]:
        result = charge(event["id"])
        transaction.set_rollback(True)
        return result

    with pytest.raises(service.WorkRolledBack):
        handle({"id": "evt_1"})
    assert (Charge.objects.count(), IdempotencyRecord.objects.count()) == (0, 0)


def test_completing_inside_a_doomed_transaction_is_refused() -> None:
    held = hold("evt_1")
    with transaction.atomic():
        charge("doomed")
        transaction.set_rollback(True)
        with pytest.raises(service.WorkRolledBack):
            service.complete(held, {"ok": True})
    assert record().status == "in_progress", "nothing claims a success that never commits"


def test_a_nested_once_for_the_same_key_is_part_of_the_same_run() -> None:
    with service.once(SCOPE, "evt_1", OP) as outer:
        with service.once(SCOPE, "evt_1", OP) as inner:
            assert inner.should_execute
            inner.result = charge("inner")
        outer.result = {"inner": inner.result}
    assert outer.result == {"inner": {"charge": Charge.objects.get().pk, "label": "inner"}}
    assert deliver("evt_1").replayed


def test_keys_reach_log_lines_escaped(caplog: pytest.LogCaptureFixture) -> None:
    key = "evt_1\r\nWARNING forged line"
    with clock.freeze():
        hold(key, lease=1)
        clock.advance(2)
        with caplog.at_level("INFO", logger="idempotency_app"):
            deliver(key)
    messages = [r.getMessage() for r in caplog.records if r.name == "idempotency_app"]
    assert messages, "the takeover is logged"
    assert all("\r" not in m and "\n" not in m for m in messages), messages


def test_a_database_that_refuses_connections_is_store_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.lifecycle.test_claims import database_down

    with database_down(monkeypatch), pytest.raises(service.StoreUnavailable):
        service.claim(SCOPE, "evt_1", OP)
    assert deliver("evt_1").should_execute


# -- renew() -----------------------------------------------------------------


def lease_seen_from_outside(key: str) -> Any:
    """The lease as another connection sees it: what other workers judge."""
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute(
                f"SELECT locked_until FROM {IdempotencyRecord._meta.db_table} WHERE {other.ops.quote_name('key')} = %s",
                [key],
            )
            return cursor.fetchone()[0]
    finally:
        other.close()


@needs_server_db
def test_renew_inside_once_commits_at_once_and_holds_no_lock() -> None:
    """Other workers see the longer lease while the work still runs, and a
    duplicate gets KeyInProgress at once instead of waiting on a row lock."""
    with service.once(SCOPE, "evt_1", OP, lease=LEASE) as run:
        before = lease_seen_from_outside("evt_1")
        assert run.renew(3600)
        after = lease_seen_from_outside("evt_1")
        assert after > before

        def duplicate() -> Any:
            try:
                return service.claim(SCOPE, "evt_1", OP)
            except service.KeyInProgress as exc:
                return exc

        [outcome] = in_threads(1, duplicate)
        assert isinstance(outcome, service.KeyInProgress), outcome
        run.result = charge("long")
    assert record().status == "completed"


needs_postgres = pytest.mark.postgresql  # its snapshot isolation levels


@contextlib.contextmanager
def session_isolation(level: str) -> Iterator[None]:
    """This connection's transactions at ``level`` (as a payments database
    configured with OPTIONS["isolation_level"] runs them)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {level}")
    try:
        yield
    finally:
        connection.close()


def on_a_side_connection(sql: str, params: list[Any]) -> None:
    """Another worker's statement: its own connection, outside the work's
    context (the work refuses writes through another connection)."""
    contextvars.Context().run(_on_a_side_connection, sql, params)


def _on_a_side_connection(sql: str, params: list[Any]) -> None:
    side = connections.create_connection("default")
    try:
        with side.cursor() as cursor:
            cursor.execute(sql, params)
    finally:
        side.close()


@needs_postgres
@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_renew_under_snapshot_isolation_lets_the_work_complete(level: str) -> None:
    """A lease renewed on a side connection would change the record after
    the work's snapshot, and the work could never complete it: every retry
    would renew and fail again. At these levels the work's own transaction
    carries the lease."""
    with session_isolation(level), service.once(SCOPE, "evt_1", OP, lease=LEASE) as run:
        Charge.objects.count()  # the work's first read takes its snapshot
        assert run.renew(600)
        run.result = charge("long task")
    assert record().status == "completed" and Charge.objects.count() == 1


@needs_postgres
def test_a_takeover_after_the_snapshot_is_claim_lost_not_store_unavailable() -> None:
    """At REPEATABLE READ a record taken over after the work's snapshot
    fails the completion with a serialization error: the claim was lost
    (409 for a view), the database is fine."""
    table = IdempotencyRecord._meta.db_table
    with (
        session_isolation("REPEATABLE READ"),
        pytest.raises(service.ClaimLost),
        service.once(SCOPE, "evt_1", OP, lease=LEASE) as run,
    ):
        Charge.objects.count()
        on_a_side_connection(
            f'UPDATE {table} SET token = %s WHERE "key" = %s', ["the-new-owner", "evt_1"]
        )
        run.result = charge("lost")
    assert Charge.objects.count() == 0 and record().token == "the-new-owner"


@needs_postgres
def test_a_serialization_failure_at_commit_is_work_rolled_back() -> None:
    """SERIALIZABLE write skew: the work and another transaction each read
    what the other writes. The work's commit fails; it did not happen, and a
    retry runs it (not 503: the database is fine)."""
    table = Charge._meta.db_table
    side = connections.create_connection("default")
    try:
        with (
            session_isolation("SERIALIZABLE"),
            pytest.raises((service.WorkRolledBack, service.ClaimLost)),
            service.once(SCOPE, "evt_1", OP) as run,
        ):
            Charge.objects.filter(label="other").count()
            side.set_autocommit(False)

            def other_transaction() -> None:  # another worker's, outside the work's context
                with side.cursor() as cursor:
                    cursor.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                    cursor.execute(f"SELECT count(*) FROM {table} WHERE label = 'work'")
                    cursor.execute(f"INSERT INTO {table} (label, amount) VALUES ('other', 1)")

            contextvars.Context().run(other_transaction)
            run.result = charge("work")
            side.commit()
    finally:
        side.close()
    assert list(Charge.objects.values_list("label", flat=True)) == ["other"]
    assert not IdempotencyRecord.objects.exists()
    assert deliver("evt_1").should_execute


def taken_over_elsewhere(key: str) -> None:
    """Another worker's takeover, committed on its own connection."""
    on_a_side_connection(
        f'UPDATE {IdempotencyRecord._meta.db_table} SET token = %s WHERE "key" = %s',
        ["the-new-owner", key],
    )


@needs_postgres
def test_renew_after_a_takeover_at_repeatable_read_says_false() -> None:
    """In place at REPEATABLE READ, renewing a record taken over after the
    work's snapshot fails to serialize: that is False (taken over), and the
    work does not commit."""
    renewed = []
    with (
        session_isolation("REPEATABLE READ"),
        pytest.raises((service.ClaimLost, service.WorkRolledBack)),
        service.once(SCOPE, "evt_1", OP, lease=LEASE) as run,
    ):
        charge("before the takeover")
        taken_over_elsewhere("evt_1")
        renewed.append(run.renew(600))
        if renewed[-1]:  # as the docs say: stop working once renew() says False
            run.result = charge("after")
    assert renewed == [False] and Charge.objects.count() == 0


@needs_postgres
def test_complete_by_hand_after_a_takeover_at_repeatable_read_is_claim_lost() -> None:
    """The same lost claim through complete(): ClaimLost, not
    StoreUnavailable (a queue would back off as for an outage)."""
    with session_isolation("REPEATABLE READ"):
        held = hold("evt_1")
        with pytest.raises(service.ClaimLost), transaction.atomic():
            Charge.objects.count()
            taken_over_elsewhere("evt_1")
            charge("lost")
            service.complete(held, {"ok": True})
    assert Charge.objects.count() == 0 and record().token == "the-new-owner"


@needs_server_db
def test_renew_after_a_caught_database_error_still_ends_rolled_back() -> None:
    """The work caught a database error, so its transaction is marked for
    rollback: renewing must not fail on that (the outcome is the rollback)."""
    with pytest.raises(service.WorkRolledBack), service.once(SCOPE, "evt_1", OP) as run:
        with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
            cursor.execute(
                "SELECT 1/0" if connection.vendor == "postgresql" else "SELECT * FROM nowhere"
            )
        assert run.renew(600)
        run.result = {"ok": True}
    assert not IdempotencyRecord.objects.exists()


def test_renew_of_a_nested_claim_needs_no_write() -> None:
    with transaction.atomic():
        held = hold("evt_1")
        assert held.nested
        with CaptureQueriesContext(connection) as queries:
            assert service.renew(held, 600)
        assert not queries.captured_queries
        service.complete(held, {"ok": True})
    assert record().status == "completed"
