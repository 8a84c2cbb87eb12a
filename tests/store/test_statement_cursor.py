"""The store's statements go through a driver cursor the connection keeps:
it must stay what a cursor of Django's would be (error translation,
execute wrappers, the query log), follow the connection through a
reconnect, and step aside for a tool that replaced ``connection.cursor``."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import DatabaseError, connection, connections
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from idempotency_app.store import backend
from idempotency_app.store.base import (
    _KEPT_CURSOR,
    CLAIMED,
    HELD_RESULT_BYTES,
    Existing,
    Identity,
    StoredResponse,
    statement_cursor,
)
from tests.conftest import new_key, post

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"label": "a", "amount": 5}
# The table, and on PostgreSQL the claim's and the completion's functions.
STORE_NAMES = ("idempotency_app_idempotencyrecord", "idempotency_claim", "idempotency_complete")


def _driver_cursor() -> Any:
    return statement_cursor(connections["default"]).cursor


def test_one_driver_cursor_serves_every_request_on_a_connection(api: APIClient) -> None:
    assert post(api, "/charges/", BODY, new_key()).status_code == 201
    kept = _driver_cursor()
    for _ in range(3):
        key = new_key()
        assert post(api, "/charges/", BODY, key).status_code == 201
        assert post(api, "/charges/", BODY, key).status_code == 201
    assert _driver_cursor() is kept


@pytest.mark.server_db  # SQLite's in-memory test database is never closed
def test_a_new_connection_gets_a_cursor_of_its_own(api: APIClient) -> None:
    key = new_key()
    assert post(api, "/charges/", BODY, key).status_code == 201
    kept = _driver_cursor()
    connection.close()
    replayed = post(api, "/charges/", BODY, key)
    assert replayed.status_code == 201 and replayed.headers["Idempotent-Replayed"] == "true"
    assert _driver_cursor() is not kept


def test_the_store_statements_are_logged_and_wrapped_as_django_cursors_are(
    api: APIClient,
) -> None:
    key = new_key()
    seen: list[str] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with CaptureQueriesContext(connection) as logged, connection.execute_wrapper(wrapper):
        assert post(api, "/charges/", BODY, key).status_code == 201
        assert post(api, "/charges/", BODY, key).status_code == 201
    store_logged = [
        q["sql"] for q in logged.captured_queries if any(name in q["sql"] for name in STORE_NAMES)
    ]
    store_seen = [sql for sql in seen if any(name in sql for name in STORE_NAMES)]
    # the claim, the completion and the replay's claim
    assert len(store_logged) >= 3 and all(store_logged)
    assert len(store_seen) >= 3


def test_errors_are_django_errors_and_leave_the_cursor_usable(api: APIClient) -> None:
    cursor = statement_cursor(connections["default"])
    with pytest.raises(DatabaseError):
        cursor.execute("SELECT * FROM no_such_table_here")
    assert post(api, "/charges/", BODY, new_key()).status_code == 201


def test_a_cursor_method_a_tool_replaced_is_called(
    api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    original = connection.cursor

    def tool_cursor(*args: Any, **kwargs: Any) -> Any:
        made.append(True)
        return original(*args, **kwargs)

    monkeypatch.setattr(connection, "cursor", tool_cursor)
    key = new_key()
    assert post(api, "/charges/", BODY, key).status_code == 201
    assert post(api, "/charges/", BODY, key).status_code == 201
    # the view's own two writes, the claim and completion, the replay's claim
    assert len(made) >= 5


@pytest.mark.server_db
@pytest.mark.parametrize(
    "large",
    [
        StoredResponse(201, (), b"x" * HELD_RESULT_BYTES),
        StoredResponse(201, (("Location", "/c/?" + "q" * HELD_RESULT_BYTES),), b"{}"),
    ],
    ids=["body", "headers"],
)
def test_a_large_replay_read_on_another_connection_lets_go_of_that_ones_cursor(
    key: str, large: StoredResponse
) -> None:
    """``found()`` lets go of the kept cursor of the connection the record
    was read on (the claim's ``connection``), not of this thread's: that
    one still holds nothing large, and keeps its cursor. Large is what was
    read: the body, or the headers stored with a small one."""
    records = backend("default")
    identity = Identity("tenant", key, "op", "fp")
    assert records.claim(identity, "t", 60, 30) is CLAIMED
    assert records.complete(identity, "t", large, 60)
    main = connections["default"]
    statement_cursor(main)  # this thread's connection keeps a cursor
    kept = vars(main)[_KEPT_CURSOR]
    side = connections.create_connection("default")
    try:
        # An execute wrapper sends the claim through the side's kept cursor.
        with side.execute_wrapper(lambda execute, *args: execute(*args)):
            found = records.claim(identity, "u", 60, 30, connection=side)
        assert isinstance(found, Existing) and found.response == large
        assert _KEPT_CURSOR not in vars(side), "the cursor that read the large body let go"
        assert vars(main).get(_KEPT_CURSOR) is kept
    finally:
        side.close()


@pytest.mark.parametrize(
    ("response", "let_go"),
    [
        (StoredResponse(201, (), b"x" * HELD_RESULT_BYTES), True),
        (StoredResponse(201, (("Location", "/c/?" + "q" * HELD_RESULT_BYTES),), b"{}"), True),
        (StoredResponse(201, (), b"{}"), False),
    ],
    ids=["large-body", "large-headers", "small"],
)
def test_a_large_completion_through_the_cursor_lets_go_of_it(
    key: str, response: StoredResponse, let_go: bool
) -> None:
    """A completion sent through the kept cursor (here an execute wrapper
    sends it there) leaves its text, the body and headers in it, held by
    the driver's cursor (psycopg's last query, MySQLdb's ``_executed``)
    until the connection's next statement: a large one lets go of it."""
    records = backend("default")
    identity = Identity("tenant", key, "op", "fp")
    main = connections["default"]
    with main.execute_wrapper(lambda execute, *args: execute(*args)):
        assert records.claim(identity, "t", 60, 30) is CLAIMED
        kept = vars(main)[_KEPT_CURSOR]
        assert records.complete(identity, "t", response, 60)
    assert (vars(main).get(_KEPT_CURSOR) is kept) is not let_go
    found = records.claim(identity, "u", 60, 30)
    assert isinstance(found, Existing) and found.response == response


@pytest.mark.server_db
def test_a_claim_on_a_side_connection_reads_what_collided_there(key: str) -> None:
    """A claim sent on a connection of its own that meets a record reads it
    on that connection: in a transaction there, the record may be one only
    that transaction sees (MariaDB's claim in a transaction reads after its
    INSERT failed). Read on the thread's own connection, it was missing."""
    records = backend("default")
    identity = Identity("tenant", key, "op", "fp")
    side = connections.create_connection("default")
    try:
        side.set_autocommit(False)
        assert records.claim(identity, "t", 60, 30, connection=side) is CLAIMED
        found = records.claim(identity, "u", 60, 30, connection=side)
        assert isinstance(found, Existing) and found.token == "t"
        side.rollback()
    finally:
        side.close()
    assert (
        records.claim(identity, "v", 60, 30) is CLAIMED
    )  # rolled back with the side's transaction
