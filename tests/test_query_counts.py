"""Database statements per request, locked in per backend.

A count is stable where a time is not: these tests fail when a change adds a
statement to a hot path (claim, replay, completion) or a savepoint. Only
statements on the idempotency table, the view's own writes and savepoints
are counted; transaction control that a backend sends by itself (SQLite's
BEGIN) is not. PostgreSQL claims and reads an existing record in one
statement; the other backends need an INSERT and then a SELECT.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from idempotency_app import clock
from idempotency_app.models import IdempotencyRecord
from tests.conftest import post
from tests.testapp.models import Charge, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)

RECORDS = IdempotencyRecord._meta.db_table.lower()
VIEW_TABLES = (Charge._meta.db_table.lower(), LedgerEntry._meta.db_table.lower())
BODY = {"label": "a", "amount": 5}
URL = "/charges/"

# The statement(s) that claim a key and, when it is taken, read the record.
CLAIM_FOUND = ["claim+read"] if connection.vendor == "postgresql" else ["claim", "read"]
CLAIM_WON = ["claim+read"] if connection.vendor == "postgresql" else ["claim"]
VIEW = ["view", "view"]


def label(sql: str) -> str | None:
    """What a statement is, or None for one that is not counted."""
    text = " ".join(sql.split()).lower()
    if text.startswith("savepoint"):
        return "savepoint"
    if text.startswith("release savepoint"):
        return "release savepoint"
    if text.startswith("rollback to savepoint"):
        return "rollback to savepoint"
    if RECORDS in text:
        if text.startswith("with"):
            return "claim+read"
        if text.startswith("insert"):
            return "claim"
        if text.startswith("select"):
            return "read"
        if text.startswith("update"):
            return "update"
        if text.startswith("delete"):
            return "delete"
        return "other record statement"
    if any(table in text for table in VIEW_TABLES):
        return "view"
    return None


def statements(call: Callable[[], Any]) -> tuple[list[str], Any]:
    with CaptureQueriesContext(connection) as captured:
        result = call()
    labels = [label(q["sql"]) for q in captured.captured_queries]
    return [name for name in labels if name is not None], result


def send(api: APIClient, key: str | None, body: dict[str, Any] | None = None) -> Callable[[], Any]:
    return lambda: post(api, URL, BODY if body is None else body, key)


def test_fresh_request_claims_writes_and_completes(api: APIClient, key: str) -> None:
    counted, response = statements(send(api, key))
    assert response.status_code == 201
    assert counted == [*CLAIM_WON, *VIEW, "update"]


def test_replay_is_one_lookup(api: APIClient, key: str) -> None:
    send(api, key)()
    counted, response = statements(send(api, key))
    assert response["Idempotent-Replayed"] == "true"
    assert counted == CLAIM_FOUND
    assert len(counted) == (1 if connection.vendor == "postgresql" else 2)


def test_mismatch_is_one_lookup(api: APIClient, key: str) -> None:
    send(api, key)()
    counted, response = statements(send(api, key, {"label": "other"}))
    assert response.status_code == 422
    assert counted == CLAIM_FOUND


def test_conflict_is_one_lookup(api: APIClient, key: str) -> None:
    send(api, key)()
    # Turn the completed record back into a claim held by a slow worker.
    IdempotencyRecord.objects.update(
        status="in_progress",
        token="other-worker",
        locked_until=clock.now() + timedelta(seconds=60),
        response_status=None,
        response_body=None,
    )
    counted, response = statements(send(api, key))
    assert response.status_code == 409
    assert counted == CLAIM_FOUND


def test_no_key_costs_nothing(api: APIClient) -> None:
    counted, response = statements(send(api, None))
    assert response.status_code == 201
    assert counted == VIEW


def test_released_outcome_rolls_back_and_deletes(api: APIClient, key: str) -> None:
    counted, response = statements(send(api, key, {**BODY, "respond": 503}))
    assert response.status_code == 503
    assert counted == [*CLAIM_WON, *VIEW, "delete"]
    assert not IdempotencyRecord.objects.exists()


def test_guard_hit_claims_then_releases(api: APIClient, key: str) -> None:
    """The guard is read under a won claim, so a hit still claims and
    releases; only the view and the completion are saved."""
    counted, first = statements(send(api, key, {"raise": "validation"}))
    assert first.status_code == 400
    assert counted == [*CLAIM_WON, "delete"]
    counted, again = statements(send(api, key, {"raise": "validation"}))
    assert again["Idempotent-Replayed"] == "true"
    assert counted == [*CLAIM_WON, "delete"]


def test_expired_record_is_taken_over(api: APIClient, key: str) -> None:
    with clock.freeze():
        send(api, key)()
        clock.advance(24 * 3600 + 1)
        counted, response = statements(send(api, key))
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert counted == [*CLAIM_FOUND, "update", *VIEW, "update"]


def test_nested_mode_adds_one_savepoint(api: APIClient, key: str) -> None:
    def inside_outer_transaction() -> Any:
        with transaction.atomic():
            return send(api, key)()

    counted, response = statements(inside_outer_transaction)
    assert response.status_code == 201
    assert counted == ["savepoint", *CLAIM_WON, *VIEW, "update", "release savepoint"]
