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
from rest_framework.test import APIClient

from idempotency_app import clock
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store.postgresql import CLAIM_FUNCTION, COMPLETE_FUNCTION
from tests.conftest import post
from tests.testapp.models import Charge, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)

RECORDS = IdempotencyRecord._meta.db_table.lower()
VIEW_TABLES = (Charge._meta.db_table.lower(), LedgerEntry._meta.db_table.lower())
BODY = {"label": "a", "amount": 5}
URL = "/charges/"


# The statement(s) that claim a key and, when it is taken, read the record.
def _one_statement_claim() -> bool:
    """PostgreSQL, and MariaDB 10.5+ outside a transaction, read the record a
    claim meets in the claim statement itself."""
    if connection.vendor == "postgresql":
        return True
    if connection.vendor != "mysql":
        return False
    connection.ensure_connection()
    return bool(connection.mysql_is_mariadb and connection.mysql_version >= (10, 5))


CLAIM_WON = ["claim+read"] if connection.vendor == "postgresql" else ["claim"]


def claim_found() -> list[str]:
    """The claim of a key that is taken, outside a transaction."""
    return CLAIM_WON if _one_statement_claim() else ["claim", "read"]


VIEW = ["view", "view"]


def label(sql: str) -> str | None:
    """What a statement is, or None for one that is not counted."""
    text = " ".join(sql.split()).lower()
    if COMPLETE_FUNCTION in text:
        # PostgreSQL: the completion as a function, in its savepoint, with the COMMIT
        return "update"
    if text.startswith("savepoint"):
        return "savepoint"
    if text.startswith("release savepoint"):
        return "release savepoint"
    if text.startswith("rollback to savepoint"):
        return "rollback to savepoint"
    if CLAIM_FUNCTION in text:
        return "claim+read"  # PostgreSQL: the claim statement as a function
    if RECORDS in text:
        if text.startswith("with done as (update"):
            return "update"  # the completion, sent with the COMMIT (PostgreSQL)
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
    """Every statement sent, including one that failed (MySQL's claim meets
    a taken key as a duplicate-key error), which the query log can miss."""
    sent: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        result = call()
    labels = [label(sql) for sql in sent]
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
    assert counted == claim_found()
    assert len(counted) == (1 if _one_statement_claim() else 2)


def test_mismatch_is_one_lookup(api: APIClient, key: str) -> None:
    send(api, key)()
    counted, response = statements(send(api, key, {"label": "other"}))
    assert response.status_code == 422
    assert counted == claim_found()


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
    assert counted == claim_found()


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
    """A validation error releases its claim leaving a marker; the retry
    takes the marker over (which tells it to read the guard) and leaves it
    again. Only the view and the completion are saved."""
    counted, first = statements(send(api, key, {"raise": "validation"}))
    assert first.status_code == 400
    assert counted == [*CLAIM_WON, "update"]
    counted, again = statements(send(api, key, {"raise": "validation"}))
    assert again["Idempotent-Replayed"] == "true"
    assert counted == [*claim_found(), "update", "update"]


def test_expired_record_is_taken_over(api: APIClient, key: str) -> None:
    with clock.freeze():
        send(api, key)()
        clock.advance(24 * 3600 + 1)
        counted, response = statements(send(api, key))
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert counted == [*claim_found(), "update", *VIEW, "update"]


def test_nested_mode_adds_one_savepoint(api: APIClient, key: str) -> None:
    def inside_outer_transaction() -> Any:
        with transaction.atomic():
            return send(api, key)()

    counted, response = statements(inside_outer_transaction)
    assert response.status_code == 201
    assert counted == ["savepoint", *CLAIM_WON, *VIEW, "update", "release savepoint"]


def test_the_first_claim_of_a_new_thread_takes_the_one_statement_form() -> None:
    """A thread's first query opens its connection, which reports autocommit
    off until then: a claim that is the first query of a new worker thread
    must still commit on its own (PostgreSQL, without waiting for the
    flush) and read a taken key in the same statement (MariaDB 10.5+)."""
    import threading

    from django.db import connections

    from idempotency_app import service

    one_statement = _one_statement_claim()
    service.claim("tenant", "first-query", "op")
    sent: list[str] = []
    outcome: list[BaseException] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(" ".join(sql.split()).lower())
        return execute(sql, params, many, context)

    def in_a_new_thread() -> None:
        try:
            with connections["default"].execute_wrapper(record):
                service.claim("tenant", "first-query", "op")
        except BaseException as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=in_a_new_thread)
    thread.start()
    thread.join(30)
    assert [type(exc) for exc in outcome] == [service.KeyInProgress]
    claims = [sql for sql in sent if RECORDS in sql or CLAIM_FUNCTION in sql]
    assert len(claims) == (1 if one_statement else 2), claims
    if connection.vendor == "postgresql":
        assert claims[0].endswith(", true)"), claims  # the function's "alone" form
    elif one_statement:
        assert "returning" in claims[0]
