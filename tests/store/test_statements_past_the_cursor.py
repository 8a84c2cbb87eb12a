"""PostgreSQL: the claim and the completion sent through libpq's own call,
past Django's cursor and psycopg's, where nobody could see the difference.

Each test sets the way past the cursor against the cursor's own: the same
rows, the same errors (Django's), and every execute wrapper, query log and
tracing cursor still sees both statements.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import DatabaseError, OperationalError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from idempotency_app import service
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import backend, postgresql
from idempotency_app.store.base import CLAIMED, Identity, StoredResponse
from tests.conftest import charge_labels as labels
from tests.store.conftest import is_completion
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:past-the-cursor"


@pytest.fixture
def sent_past() -> Iterator[list[str]]:
    """The statements the store sent past the cursor, by kind."""
    sent: list[str] = []
    call, complete = postgresql.Backend._call_unseen, postgresql._complete_unseen

    def counted_call(*args: Any, **kwargs: Any) -> Any:
        sent.append("claim")
        return call(*args, **kwargs)

    def counted_complete(*args: Any, **kwargs: Any) -> Any:
        sent.append("completion")
        return complete(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(postgresql.Backend, "_call_unseen", counted_call)
        patch.setattr(postgresql, "_complete_unseen", counted_complete)
        yield sent


def charge(key: str, label: str = "a") -> Any:
    with service.once(SCOPE, key, "tests.past_the_cursor") as run:
        if run.should_execute:
            Charge.objects.create(label=label)
            run.result = {"label": label}
    return run


def test_a_fresh_run_and_its_replay_skip_the_cursors(sent_past: list[str]) -> None:
    """Without this the lever would silently never run: the claim, the
    completion and the replay's claim all go past the cursor, and the
    replay reads the stored result as the cursor would have."""
    key = str(uuid.uuid4())
    first = charge(key)
    assert first.should_execute and sent_past == ["claim", "completion"]
    again = charge(key, "b")
    assert not again.should_execute and again.result == {"label": "a"}
    assert sent_past == ["claim", "completion", "claim"]
    assert labels() == ["a"]


def test_the_replayed_record_reads_as_through_the_cursor() -> None:
    """The record a claim meets, read past the cursor and through it with a
    wrapper installed: equal, body bytes and headers included."""
    store = backend("default")
    identity = Identity(SCOPE, str(uuid.uuid4()), "op", "f" * 64)
    assert store.claim(identity, "token-1", 60, 30) is CLAIMED
    headers = (("X-Ünïcode", "ÿes"), ("Content-Type", "a/b"))
    response = StoredResponse(201, headers, b"\x00\xff body")
    with transaction.atomic():
        assert store.complete(identity, "token-1", response, 60)
    past = store.claim(identity, "token-2", 60, 30)
    with connection.execute_wrapper(lambda execute, *args: execute(*args)):
        through = store.claim(identity, "token-2", 60, 30)
    assert past == through
    assert past.response == response  # type: ignore[union-attr]


def _seen(wrap: Callable[[], Any]) -> list[str]:
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        wrap()
    return seen


def test_an_execute_wrapper_sees_the_claim_and_the_completion(sent_past: list[str]) -> None:
    seen = _seen(lambda: charge(str(uuid.uuid4())))
    assert sent_past == []
    assert any(postgresql.CLAIM_FUNCTION in sql for sql in seen), seen
    assert any("COMMIT" in sql and is_completion(sql) for sql in seen), seen


def test_the_query_log_sees_the_claim_and_the_completion(sent_past: list[str]) -> None:
    with CaptureQueriesContext(connection) as queries:
        charge(str(uuid.uuid4()))
    logged = [q["sql"] for q in queries.captured_queries]
    assert sent_past == []
    assert any(postgresql.CLAIM_FUNCTION in sql for sql in logged), logged
    assert any(is_completion(sql) for sql in logged), logged


def test_a_tracing_driver_cursor_sees_the_claim_and_the_completion(
    sent_past: list[str],
) -> None:
    """An agent that traces at the driver (OpenTelemetry's psycopg
    instrumentation sets its own cursor class) misses nothing."""
    connection.ensure_connection()
    raw = connection.connection
    factory = raw.cursor_factory
    traced: list[str] = []

    class Tracing(factory):  # type: ignore[misc, valid-type]
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            traced.append(str(query))
            return super().execute(query, *args, **kwargs)

    raw.cursor_factory = Tracing
    try:
        connection.__dict__.pop("_idempotency_statement_cursor", None)
        charge(str(uuid.uuid4()))
    finally:
        raw.cursor_factory = factory
        connection.close()
    assert sent_past == []
    assert any(postgresql.CLAIM_FUNCTION in sql for sql in traced), traced
    assert any(is_completion(sql) for sql in traced), traced


@pytest.mark.parametrize("past", [True, False])
def test_a_nul_in_the_key_is_refused_not_cut(past: bool) -> None:
    """libpq reads a parameter up to its first NUL: sent past the cursor,
    "a\\x00b" would be claimed as "a", a stranger's key. psycopg refuses
    it, with or without an execute wrapper in the way."""
    store = backend("default")
    prefix = str(uuid.uuid4())
    assert store.claim(Identity(SCOPE, prefix, "op", "f"), "t", 60, 30) is CLAIMED

    def claim() -> Any:
        return store.claim(Identity(SCOPE, prefix + "\x00b", "op", "f"), "t2", 60, 30)

    with pytest.raises(DatabaseError, match="NUL"):
        if past:
            claim()
        else:
            with connection.execute_wrapper(lambda execute, *args: execute(*args)):
                claim()


def test_a_session_not_in_utf8_stores_its_text_as_the_cursor_does(sent_past: list[str]) -> None:
    """In a LATIN1 session text must go in that encoding: sent past the
    cursor as UTF-8 it would be stored mangled."""
    store = backend("default")
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SET client_encoding TO 'LATIN1'")
    try:
        scope = "tenant-é"
        identity = Identity(scope, str(uuid.uuid4()), "op-ü", "f")
        assert store.claim(identity, "t", 60, 30) is CLAIMED
        record = IdempotencyRecord.objects.get(key=identity.key)
        assert (record.scope, record.operation) == (scope, "op-ü")
    finally:
        connection.close()
    assert sent_past == []


def test_a_killed_backend_at_the_claim_raises_djangos_error(sent_past: list[str]) -> None:
    """The claim's error past the cursor is Django's, and marks the
    connection for Django to close, as the cursor's would."""
    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()
    store = backend("default")
    with pytest.raises(OperationalError):
        store.claim(Identity(SCOPE, str(uuid.uuid4()), "op", "f"), "t", 60, 30)
    assert sent_past == ["claim"]
    assert connection.errors_occurred
    connection.close()


def test_a_completion_that_matches_no_claim_rolls_the_work_back(sent_past: list[str]) -> None:
    """Sent past the cursor with its COMMIT, a completion whose claim was
    taken over mid-work must still turn the COMMIT into a rollback."""
    from idempotency_app.exceptions import ClaimLost

    key = str(uuid.uuid4())
    other = connections.create_connection("default")

    def steal() -> None:
        with other.cursor() as cursor:
            cursor.execute(
                f"UPDATE {IdempotencyRecord._meta.db_table} SET token = 'thief' WHERE key = %s",
                [key],
            )

    try:
        with pytest.raises(ClaimLost), service.once(SCOPE, key, "tests.past_the_cursor") as run:
            if run.should_execute:
                Charge.objects.create(label="a")
                contextvars.Context().run(steal)  # another worker, outside this work
                run.result = "done"
    finally:
        other.close()
    assert sent_past == ["claim", "completion"]
    assert labels() == []
    assert IdempotencyRecord.objects.get(key=key).token == "thief"
