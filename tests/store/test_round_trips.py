"""Round trips to the database per request, counted on the wire.

Statements (``test_query_counts.py``) are not the whole cost: transaction
control the driver sends by itself (psycopg's BEGIN, mysqlclient's SET
autocommit) waits for the server too. Here every message that waits for an
answer is counted where it happens: on PostgreSQL from libpq's protocol
trace (one ReadyForQuery per simple query or Sync), on MariaDB from the
session's ``Questions`` counter. A fresh request must add no round trip but
the claim, the BEGIN of the work's transaction and the completion, which on
PostgreSQL travels with the COMMIT.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from idempotency_app.store import backend
from idempotency_app.store.postgresql import CLAIM_FUNCTION, COMPLETE_FUNCTION, COMPLETING
from tests.conftest import post

pytestmark = [pytest.mark.server_db, pytest.mark.django_db(transaction=True)]

BODY = {"label": "a", "amount": 5}
CLAIM_CALL = f"SELECT * FROM {CLAIM_FUNCTION}".upper()
# The completion as the function, in its savepoint (the trace keeps 40 characters).
COMPLETE_CALL = f"SAVEPOINT {COMPLETING}; SELECT {COMPLETE_FUNCTION}(".upper()[:40]


@contextlib.contextmanager
def _postgresql_trips() -> Iterator[list[str]]:
    """The first message of each round trip, from libpq's trace."""
    from psycopg import pq

    trips: list[str] = []
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile() as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield trips
        finally:
            pgconn.untrace()
        trace.seek(0)
        first = None
        for line in trace.read().decode("utf-8", "replace").splitlines():
            direction, _, kind, *rest = line.split("\t")
            if direction == "F" and first is None:
                first = (rest[0].strip(' "')[:40] if kind == "Query" else kind).upper()
            elif direction == "B" and kind == "ReadyForQuery":
                trips.append(first or "")
                first = None


def _mysql_questions() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
        return int(cursor.fetchone()[1])


@contextlib.contextmanager
def _mysql_trips() -> Iterator[list[str]]:
    """One entry per statement the session sent (the server does not say
    which; the SHOW that reads the counter is left out)."""
    trips: list[str] = []
    connection.ensure_connection()
    before = _mysql_questions()
    try:
        yield trips
    finally:
        trips.extend(["?"] * (_mysql_questions() - before - 1))


def round_trips(call: Callable[[], Any]) -> tuple[list[str], Any]:
    """What ``call`` sent that waited for the server, and its result. The
    test client keeps the connection across the request, so one session's
    counts are the request's."""
    counting = _postgresql_trips if connection.vendor == "postgresql" else _mysql_trips
    if connection.vendor == "postgresql":
        connection.ensure_connection()
        backend(connection.alias).claim_statement(True)  # asked once per process
    with counting() as trips:
        result = call()
    return trips, result


def test_a_fresh_request_adds_the_claim_a_begin_and_the_completion(
    api: APIClient, key: str
) -> None:
    plain, response = round_trips(lambda: post(api, "/charges/", BODY, None))
    assert response.status_code == 201
    fresh, response = round_trips(lambda: post(api, "/charges/", BODY, key))
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    if connection.vendor == "postgresql":
        # The view's two INSERTs run in autocommit when undecorated.
        assert len(plain) == 2, plain
        assert len(fresh) == len(plain) + 3, fresh
        # The claim: a simple query, or Parse/Bind where it is prepared.
        assert fresh[0].startswith((CLAIM_CALL, "PARSE", "BIND")), fresh
        assert fresh[1] == "BEGIN", fresh
        assert fresh[-1].startswith(COMPLETE_CALL), "the completion carries the COMMIT"
    else:
        # The claim; SET autocommit=0, the completion, COMMIT, SET autocommit=1.
        assert len(fresh) == len(plain) + 5, (plain, fresh)


def test_a_replay_is_one_round_trip(api: APIClient, key: str) -> None:
    post(api, "/charges/", BODY, key)
    trips, response = round_trips(lambda: post(api, "/charges/", BODY, key))
    assert response["Idempotent-Replayed"] == "true"
    one_statement = connection.vendor == "postgresql" or (
        connection.mysql_is_mariadb and connection.mysql_version >= (10, 5)
    )
    assert len(trips) == (1 if one_statement else 2), trips


@pytest.mark.postgresql
def test_the_completion_and_commit_leave_django_nothing_to_send(api: APIClient, key: str) -> None:
    """Django's own COMMIT finds the transaction ended and sends nothing."""
    trips, response = round_trips(lambda: post(api, "/charges/", BODY, key))
    assert response.status_code == 201
    assert "COMMIT" not in trips, trips


def _prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.postgresql
def test_the_claim_is_prepared_where_options_allow_it(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OPTIONS prepare_threshold, the server stops parsing and planning
    the claim once psycopg has run it that many times on the connection;
    Django's own statements (client-side binding) are never prepared."""
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "prepare_threshold", 5)
    connection.close()  # a session of its own, opened with the option
    try:
        for n in range(6):
            post(api, "/charges/", BODY, f"{key}-{n}")
        prepared = _prepared()
    finally:
        connection.close()
    assert len(prepared) == 1 and CLAIM_FUNCTION in prepared[0], prepared


@pytest.mark.postgresql
def test_nothing_is_prepared_by_default(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Django leaves preparing off, for connection poolers (PgBouncer's
    transaction pooling before 1.21): a prepared statement lives in one
    server session, which the next transaction may not get."""
    monkeypatch.delitem(connection.settings_dict["OPTIONS"], "prepare_threshold", raising=False)
    connection.close()
    try:
        for n in range(6):
            post(api, "/charges/", BODY, f"{key}-{n}")
        assert _prepared() == []
    finally:
        connection.close()


def test_work_in_a_transaction_adds_only_the_claim(key: str) -> None:
    """A duplicate must see the claim, so it is a round trip of its own; on
    PostgreSQL the view's atomic() block becomes a savepoint that goes with
    the BEGIN, its RELEASE rides with the COMMIT, and the completion rides
    with the COMMIT too. MySQL's driver takes one statement per call: there
    the SAVEPOINT, the RELEASE and the completion add three more."""
    from idempotency_app import service
    from tests.testapp.models import Charge

    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="a")
            Charge.objects.create(label="b")
        return "done"

    def under_a_key() -> Any:
        with service.once("tests:trips", key, "op") as run:
            run.result = work()
        return run.result

    alone, _ = round_trips(work)
    keyed, result = round_trips(under_a_key)
    assert result == "done"
    if connection.vendor == "postgresql":
        assert len(alone) == 4, alone  # BEGIN, two INSERTs, COMMIT
        assert len(keyed) == len(alone) + 1, keyed
        assert keyed[1].startswith("BEGIN; SAVEPOINT"), keyed
        assert keyed[0].startswith((CLAIM_CALL, "PARSE", "BIND")), keyed
    else:
        # SET autocommit=0, two INSERTs, COMMIT, SET autocommit=1.
        assert len(alone) == 5, alone
        assert len(keyed) == len(alone) + 4, keyed


@pytest.mark.postgresql
def test_the_completion_reuses_what_psycopg_made_of_its_text(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """psycopg turns a statement's text into a template once and caches it
    by the whole text. On a connection kept across requests (CONN_MAX_AGE),
    the releases sent in front of the completion carry savepoint names that
    differ per request: joined before binding, every completion was a new
    text to parse (and one more entry in the cache)."""
    from psycopg import _queries

    monkeypatch.setitem(connection.settings_dict, "CONN_MAX_AGE", 60)
    connection.close()  # opened again with the setting
    try:
        url = "/patterns/tag-if-new-atomic/"  # a block whose RELEASE the completion carries
        for n in range(3):  # every statement of the request seen once
            post(api, url, {**BODY, "tag": f"{key}-warm-{n}"}, f"{key}-warm-{n}")
        before = _queries._query2pg_client.cache_info().misses
        for n in range(5):
            assert post(api, url, {**BODY, "tag": f"{key}-{n}"}, f"{key}-{n}").status_code == 201
        assert _queries._query2pg_client.cache_info().misses == before
    finally:
        connection.close()
