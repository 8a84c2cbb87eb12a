"""The example project: its webhook receiver, its batch command and the
charges endpoint's demo delay."""

from __future__ import annotations

import json
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings

from idempotency_app import service
from idempotency_app.models import IdempotencyRecord
from tests.concurrency import in_threads
from tests.conftest import needs_server_db

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def payments(transactional_db: Any) -> Iterator[Any]:
    """The example's webhook module and models, served by the example's URLs."""
    from example_project.payments import models, webhooks

    with override_settings(ROOT_URLCONF="example_project.urls"):
        yield webhooks, models


@pytest.fixture
def account(payments: Any, user: Any) -> Any:
    _, models = payments
    return models.Account.objects.create(owner=user, name="main", balance=0)


def event(
    event_id: str, account: Any, amount: int = 500, kind: str = "payment.received"
) -> dict[str, Any]:
    return {"id": event_id, "type": kind, "data": {"account": account.pk, "amount": amount}}


def send(webhooks: Any, body: dict[str, Any] | bytes, provider: str = "acme", **extra: Any) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    signature = webhooks.sign(provider, raw) if provider in webhooks.PROVIDERS else ""
    headers = {"HTTP_X_SIGNATURE": signature, **extra}
    return Client().post(f"/webhooks/{provider}/", raw, content_type="application/json", **headers)


def balance(account: Any) -> int:
    account.refresh_from_db()
    return int(account.balance)


def test_an_event_delivered_ten_times_is_credited_once(payments: Any, account: Any) -> None:
    webhooks, models = payments
    responses = [send(webhooks, event("evt_1", account)) for _ in range(10)]
    assert [r.status_code for r in responses] == [200] * 10
    bodies = [r.json() for r in responses]
    assert [b["replayed"] for b in bodies] == [False] + [True] * 9
    assert all(b["result"] == bodies[0]["result"] for b in bodies)
    assert bodies[0]["result"]["status"] == "credited"
    assert models.ProviderPayment.objects.count() == 1
    assert balance(account) == 500
    record = IdempotencyRecord.objects.get(scope="provider:acme")
    assert (record.scope, record.key, record.operation) == (
        "provider:acme",
        "evt_1",
        webhooks.OPERATION,
    )


def test_distinct_events_are_each_credited(payments: Any, account: Any) -> None:
    webhooks, _ = payments
    send(webhooks, event("evt_1", account, 100))
    send(webhooks, event("evt_2", account, 200))
    send(webhooks, event("evt_1", account, 100))
    assert balance(account) == 300


@needs_server_db
def test_concurrent_copies_run_once_and_all_get_the_result(
    payments: Any, account: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    webhooks, models = payments
    # Room for a loaded machine: the copies must wait for the first however
    # slowly it runs, or the test would measure speed instead of behaviour.
    monkeypatch.setattr(webhooks, "WAIT_FOR_FIRST", 30)

    def deliver() -> tuple[int, Any]:
        response = send(webhooks, event("evt_1", account))
        return response.status_code, response.json()

    bodies = in_threads(6, deliver)
    assert [status for status, _ in bodies] == [200] * 6
    assert len({json.dumps(body["result"]) for _, body in bodies}) == 1
    assert sum(not body["replayed"] for _, body in bodies) == 1
    assert models.ProviderPayment.objects.count() == 1
    assert balance(account) == 500


def test_a_copy_with_other_contents_is_refused(payments: Any, account: Any) -> None:
    webhooks, _ = payments
    send(webhooks, event("evt_1", account, 100))
    response = send(webhooks, event("evt_1", account, 999))
    assert response.status_code == 422
    assert balance(account) == 100


def test_delivery_fields_do_not_count_as_other_contents(payments: Any, account: Any) -> None:
    webhooks, _ = payments
    send(webhooks, {**event("evt_1", account), "attempt": 1})
    again = send(webhooks, {**event("evt_1", account), "attempt": 2})
    assert again.status_code == 200 and again.json()["replayed"] is True


def test_an_event_in_progress_elsewhere_gets_409(
    payments: Any, account: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    webhooks, _ = payments
    body = event("evt_1", account)
    held = service.claim("provider:acme", "evt_1", webhooks.OPERATION, webhooks.facts(body))
    assert isinstance(held, service.Held)
    monkeypatch.setattr(webhooks, "WAIT_FOR_FIRST", 0)
    response = send(webhooks, body)
    assert response.status_code == 409 and int(response["Retry-After"]) >= 1
    assert balance(account) == 0


def test_unhandled_and_impossible_events_are_answered_once(payments: Any, account: Any) -> None:
    webhooks, _ = payments
    ignored = send(webhooks, event("evt_1", account, kind="customer.updated"))
    rejected = send(webhooks, {"id": "evt_2", "type": "payment.received", "data": {"account": 0}})
    assert ignored.json()["result"]["status"] == "ignored"
    assert rejected.json()["result"]["status"] == "rejected"
    assert IdempotencyRecord.objects.filter(status="completed").count() == 2


@pytest.mark.parametrize("case", ["signature", "provider", "json", "id", "nul-id"])
def test_bad_deliveries_are_refused_and_not_recorded(
    payments: Any, account: Any, case: str
) -> None:
    webhooks, _ = payments
    if case == "signature":
        response = send(webhooks, event("evt_1", account), HTTP_X_SIGNATURE="sha256=forged")
    elif case == "provider":
        response = send(webhooks, event("evt_1", account), provider="nobody")
    elif case == "json":
        response = send(webhooks, b"{not json")
    elif case == "nul-id":
        response = send(webhooks, event("evt_\x00", account))
    else:
        response = send(webhooks, {"type": "payment.received"})
    assert response.status_code == (404 if case == "provider" else 400)
    assert not IdempotencyRecord.objects.exists()
    assert balance(account) == 0


# -- the batch command ------------------------------------------------------------


def write_batch(path: Path, events: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + "\n")
    return str(path)


def test_a_batch_is_processed_exactly_once(payments: Any, account: Any, tmp_path: Path) -> None:
    webhooks, models = payments
    send(webhooks, event("evt_1", account, 100))
    batch = [
        event("evt_1", account, 100),
        event("evt_2", account, 200),
        event("evt_2", account, 200),
    ]
    batch.append(event("evt_3", account, 300))
    path = write_batch(tmp_path / "events.jsonl", batch)
    out = StringIO()
    call_command("process_events", path, stdout=out)
    assert (
        out.getvalue().strip()
        == "2 processed, 1 already processed, 0 in progress elsewhere, 0 conflicting."
    )
    assert balance(account) == 600
    again = StringIO()
    with CaptureQueriesContext(connection) as queries:
        call_command("process_events", path, stdout=again)
    assert "0 processed, 3 already processed" in again.getvalue()
    idempotency_queries = [q for q in queries.captured_queries if "idempotency" in q["sql"]]
    assert len(idempotency_queries) == 1, "one batch lookup, no claims"
    assert models.ProviderPayment.objects.count() == 3 and balance(account) == 600


def test_a_webhook_copy_after_the_batch_replays(
    payments: Any, account: Any, tmp_path: Path
) -> None:
    webhooks, _ = payments
    call_command(
        "process_events",
        write_batch(tmp_path / "e.jsonl", [event("evt_1", account)]),
        stdout=StringIO(),
    )
    response = send(webhooks, event("evt_1", account))
    assert response.json()["replayed"] is True
    assert balance(account) == 500


def test_events_in_progress_elsewhere_fail_the_batch(
    payments: Any, account: Any, tmp_path: Path
) -> None:
    webhooks, _ = payments
    busy = event("evt_2", account, 200)
    held = service.claim("provider:acme", "evt_2", webhooks.OPERATION, webhooks.facts(busy))
    assert isinstance(held, service.Held)
    path = write_batch(tmp_path / "e.jsonl", [event("evt_1", account, 100), busy])
    with pytest.raises(CommandError, match="1 events are in progress elsewhere"):
        call_command("process_events", path, stdout=StringIO(), stderr=StringIO())
    assert balance(account) == 100
    service.release(held)
    call_command("process_events", path, stdout=StringIO())
    assert balance(account) == 300


def test_a_malformed_line_stops_the_batch_before_any_work(
    payments: Any, account: Any, tmp_path: Path
) -> None:
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps(event("evt_1", account)) + "\n{oops\n")
    with pytest.raises(CommandError, match="Line 2"):
        call_command("process_events", str(path), stdout=StringIO())
    assert not IdempotencyRecord.objects.exists()


def test_a_file_that_is_not_utf8_is_refused_before_any_work(
    payments: Any, account: Any, tmp_path: Path
) -> None:
    path = tmp_path / "e.jsonl"
    path.write_bytes(json.dumps(event("evt_1", account)).encode() + b"\n\xff\xfe\n")
    with pytest.raises(CommandError, match="not UTF-8 text"):
        call_command("process_events", str(path), stdout=StringIO())
    assert not IdempotencyRecord.objects.exists()


# -- the charges endpoint's demo delay ----------------------------------------------


def charge_with_delay(account: Any, delay: str) -> Any:
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(account.owner)
    with override_settings(DEBUG=True):
        return client.post(
            f"/api/accounts/{account.pk}/charges/?simulate_delay={delay}",
            {"amount": 100},
            format="json",
            HTTP_IDEMPOTENCY_KEY=f"delay-{delay}",
        )


def test_a_simulated_delay_still_charges(payments: Any, account: Any) -> None:
    assert charge_with_delay(account, "0.01").status_code == 201
    assert balance(account) == -100


@pytest.mark.parametrize("delay", ["soon", "nan", "-1", "31"])
def test_a_bad_simulated_delay_is_a_client_error(payments: Any, account: Any, delay: str) -> None:
    response = charge_with_delay(account, delay)
    assert response.status_code == 400, response.content
    assert "simulate_delay" in response.json()
    assert balance(account) == 0


def test_the_webhook_enqueues_the_receipt_once(payments: Any, account: Any) -> None:
    webhooks, models = payments
    for _ in range(3):
        assert send(webhooks, event("evt_r", account)).status_code == 200
    payment = models.ProviderPayment.objects.get()
    assert IdempotencyRecord.objects.filter(scope="receipts").count() == 1
    if "django_tasks_db" in settings.INSTALLED_APPS:
        from django_tasks_db.models import DBTaskResult

        task = DBTaskResult.objects.get()
        assert task.task_path == "example_project.payments.tasks.send_receipt"
        assert models.Receipt.objects.count() == 0, "the worker sends it"
        from example_project.payments.tasks import send_receipt

        # What db_worker does with the row, twice (a re-run): one receipt.
        first = send_receipt.call(payment.pk)
        assert send_receipt.call(payment.pk) == first
    assert models.Receipt.objects.get().payment == payment
