"""PostgreSQL: the completion sent with the COMMIT as a PL/pgSQL function
(migration 0008), which the server plans once per session instead of once
per fresh request.

The function must be the completion statement and nothing else, must store
exactly what the statement stores, must fail where the statement fails (a
claim taken over rolls the work back), and a database where the migration
has not run, or where it was rolled back under a running process, must
still complete correctly, with the statement itself.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.apps import apps
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import backend, postgresql
from idempotency_app.store.base import CLAIMED, Identity, StoredResponse
from tests.conftest import post
from tests.store.conftest import complete_in_a_block, dropped, function_source
from tests.store.test_claim_function_attacks import odd_identities
from tests.testapp.models import Charge

pytestmark = [pytest.mark.postgresql, pytest.mark.django_db(transaction=True)]

MIGRATION = importlib.import_module("idempotency_app.migrations.0008_completion_function")
RESPONSE = StoredResponse(
    201, (("Content-Type", "application/json"), ("X-Odd", "%s ' \\ $$")), b'{"id": 1} %s \x00'
)


def _compact(sql: str) -> str:
    return "".join(sql.split())


def _store(by_function: bool) -> postgresql.Backend:
    s = postgresql.Backend("default")
    s.claims_by_function, s.completes_by_function = True, by_function
    return s


@pytest.fixture
def without_the_function() -> Iterator[None]:
    """As on a database still at migration 0007."""
    with dropped(MIGRATION):
        yield


def test_the_function_runs_the_completion_statement_and_nothing_else() -> None:
    """Kept in step with the statement the store sends without it: a change
    to one without the other fails here."""
    source = function_source(postgresql._COMPLETE_SIGNATURE)
    update = source.split("BEGIN", 1)[1].split(";", 1)[0]
    statement = postgresql.Backend("default").complete_sql
    for name in ("scope", "key", "token", "expires", "status", "headers", "body"):
        statement = statement.replace(f"%({name})s", f"_{name}")
    assert _compact(update) == _compact(statement)
    # And it fails, as the statement does, unless it matched exactly one row.
    assert "IFmatched<>1THENRAISEEXCEPTION" in _compact(source)
    assert postgresql.CLAIM_LOST in source


def test_the_store_asks_for_both_functions_at_its_first_claim(key: str) -> None:
    s = postgresql.Backend("default")
    assert s.claims_by_function is None and s.completes_by_function is False
    assert s.claim(Identity("tenant", key, "op", "fp"), "tok", 60, 30) is CLAIMED
    assert (s.claims_by_function, s.completes_by_function) == (True, True)


@pytest.mark.parametrize("with_release", [False, True])
def test_the_function_stores_what_the_statement_stores(with_release: bool, key: str) -> None:
    """Odd scopes, keys and responses (quotes, placeholders, backslashes,
    NUL bytes, long and astral text), each completed once by each form:
    the same record but for its key."""
    for n, identity in enumerate(odd_identities(key)):
        rows = []
        for by_function in (False, True):
            # The charge's label holds the key: at most 100 characters.
            one = Identity(identity.scope, f"{identity.key[:40]}{n}{by_function}{key}", "op", "fp")
            s = _store(by_function)
            assert s.claim(one, "tok", 60, 30) is CLAIMED
            assert complete_in_a_block(s, one, RESPONSE, with_release)
            rows.append(IdempotencyRecord.objects.get(scope=one.scope, key=one.key))
        by_statement, by_function_row = rows
        for field in ("status", "locked_until", "response_status", "response_headers"):
            assert getattr(by_function_row, field) == getattr(by_statement, field), field
        assert bytes(by_function_row.response_body) == bytes(by_statement.response_body)
        assert by_function_row.status == IdempotencyRecord.Status.COMPLETED
        assert bytes(by_function_row.response_body) == RESPONSE.body
        gap = by_function_row.expires_at - by_statement.expires_at
        assert abs(gap) < timedelta(seconds=5)


@pytest.mark.parametrize("token", ["other", None])
def test_a_claim_taken_over_fails_the_function_and_rolls_the_work_back(
    token: str | None, key: str
) -> None:
    """Another token holds the key, or no record is left: the COMMIT after
    the function must not run."""
    from django.db import DatabaseError

    identity = Identity("tenant", key, "op", "fp")
    s = _store(True)
    assert s.claim(identity, "tok", 60, 30) is CLAIMED
    record = IdempotencyRecord.objects.filter(scope="tenant", key=key)
    if token is None:
        record.delete()
    else:
        record.update(token=token)
    with pytest.raises(DatabaseError, match="the claim was taken over"):
        complete_in_a_block(s, identity, RESPONSE, with_release=True)
    assert not Charge.objects.filter(label=key).exists()
    assert not IdempotencyRecord.objects.filter(
        key=key, status=IdempotencyRecord.Status.COMPLETED
    ).exists()


@pytest.mark.usefixtures("without_the_function")
def test_before_the_migration_the_store_completes_with_the_statement(key: str) -> None:
    s = postgresql.Backend("default")
    identity = Identity("tenant", key, "op", "fp")
    assert s.claim(identity, "tok", 60, 30) is CLAIMED
    assert (s.claims_by_function, s.completes_by_function) == (True, False)
    assert complete_in_a_block(s, identity, RESPONSE, with_release=True)
    assert IdempotencyRecord.objects.get(key=key).status == IdempotencyRecord.Status.COMPLETED


@pytest.mark.parametrize("logged", [False, True], ids=["past-the-cursor", "django-cursor"])
def test_a_function_dropped_under_a_running_process_costs_no_request(
    logged: bool, quiet_api: APIClient, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A migration back to 0007 while a process runs: the completion that
    meets the missing function goes back to its savepoint and sends the
    statement, the work intact; the process sends the statement from then
    on. The request gets its 201, and runs once: through libpq's own call,
    and through Django's cursor (where queries are logged)."""
    body = {"label": key, "amount": 5}
    assert post(quiet_api, "/charges/", {"label": f"{key}-warm", "amount": 1}, f"{key}-warm")
    store = backend("default")
    assert store.completes_by_function is True
    with dropped(MIGRATION):
        with (
            caplog.at_level(logging.WARNING, logger="idempotency_app"),
            CaptureQueriesContext(connection) if logged else contextlib.nullcontext(),
        ):
            first = post(quiet_api, "/charges/", body, key)
        assert first.status_code == 201, first.content
        assert store.completes_by_function is False
        assert postgresql.COMPLETE_FUNCTION in caplog.text
        replay = post(quiet_api, "/charges/", body, key)
        assert replay["Idempotent-Replayed"] == "true"
        assert replay.json() == first.json()
        assert Charge.objects.filter(label=key).count() == 1


def test_requests_in_flight_when_the_function_is_dropped_all_complete(key: str) -> None:
    """Four requests of one process are inside their work when the function
    is dropped: each completes, none is rolled back, and each record has
    its charge."""
    from idempotency_app import service

    store = backend("default")
    with service.once("tests:completion-function", f"{key}-warm", "op") as warm:
        warm.result = 1
    assert store.completes_by_function is True
    count = 4
    inside, go = threading.Barrier(count + 1), threading.Event()
    outcomes: list[str] = []

    def one(n: int) -> None:
        try:
            with service.once("tests:completion-function", f"{key}-{n}", "op") as run:
                Charge.objects.create(label=f"{key}-{n}", amount=1)
                inside.wait()
                go.wait()
                run.result = n
            outcomes.append("ok")
        except Exception as exc:
            outcomes.append(type(exc).__name__)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    inside.wait()
    with dropped(MIGRATION):
        go.set()
        for thread in threads:
            thread.join()
        assert outcomes == ["ok"] * count, outcomes
        for n in range(count):
            done = IdempotencyRecord.objects.filter(key=f"{key}-{n}", status="completed")
            assert done.count() == Charge.objects.filter(label=f"{key}-{n}").count() == 1


# -- A tenant's schema still at 0007, after one at 0008 ------------------------

TABLES = (IdempotencyRecord._meta.db_table, Charge._meta.db_table)
MIGRATED, BEHIND = "idem_tenant_0008", "idem_tenant_0007"
CLAIM_MIGRATION = importlib.import_module("idempotency_app.migrations.0007_claim_function")


def _search_path(path: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"SET search_path TO {path}")


@pytest.fixture
def tenants() -> Iterator[None]:
    """Two tenants' schemas, each with its own table: one migrated to 0008,
    one still at 0007 (the claim function only), as in a migration of
    every tenant's schema half done."""
    connection.ensure_connection()
    for schema, migrations in (
        (MIGRATED, (CLAIM_MIGRATION, MIGRATION)),
        (BEHIND, (CLAIM_MIGRATION,)),
    ):
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            cursor.execute(f"CREATE SCHEMA {schema}")
            for table in TABLES:
                cursor.execute(
                    f'CREATE TABLE {schema}."{table}" (LIKE public."{table}" INCLUDING ALL)'
                )
        _search_path(schema)
        for migration in migrations:
            with connection.schema_editor() as editor:
                migration._create(apps, editor)
    _search_path("public")
    try:
        yield
    finally:
        connection.close()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA IF EXISTS {MIGRATED} CASCADE")
            cursor.execute(f"DROP SCHEMA IF EXISTS {BEHIND} CASCADE")
        backend("default").claims_by_function = None
        connection.close()


@pytest.mark.usefixtures("tenants")
def test_a_tenant_still_at_0007_after_one_at_0008_completes(key: str) -> None:
    """The process learns of both functions in the migrated tenant; the
    other tenant's completion falls back to the statement, the work intact,
    each record with its charge in its own schema."""
    s = postgresql.Backend("default")
    try:
        for n, schema in enumerate((MIGRATED, BEHIND)):
            _search_path(schema)
            identity = Identity("tenant", f"{key}-{n}", "op", "fp")
            assert s.claim(identity, "tok", 60, 30) is CLAIMED
            assert complete_in_a_block(s, identity, RESPONSE, with_release=True)
            assert s.completes_by_function is (schema == MIGRATED)
            with connection.cursor() as cursor:
                cursor.execute(
                    f'SELECT (SELECT count(*) FROM {schema}."{TABLES[0]}" WHERE key = %s AND '
                    f"status = 'completed'), (SELECT count(*) FROM {schema}.\"{TABLES[1]}\" "
                    "WHERE label = %s)",
                    [identity.key, identity.key],
                )
                assert cursor.fetchone() == (1, 1), schema
    finally:
        connection.close()
