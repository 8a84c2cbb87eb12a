"""Attacks on the driver cursor the store keeps per connection
(``store.base.statement_cursor``): two threads sharing a connection, a
backend that readies each cursor in ``_cursor()`` (django-tenants), the
query log, a large replayed body, a session killed under it, health checks,
failed statements, the sweep and the admin's release, and pipeline mode,
where each store statement must read its own result."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.management import call_command
from django.db import DatabaseError, connection, connections
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import backend
from idempotency_app.store.base import CLAIMED, Existing, Identity, StoredResponse
from tests.conftest import end_session, new_key, post, session_id
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"label": "a", "amount": 5}


def test_a_claim_reads_its_own_row_while_another_thread_shares_the_connection() -> None:
    if connections["default"].vendor == "mysql":
        pytest.skip("mysqlclient connections cannot be shared between threads at all")
    store = backend("default")
    conn = connections["default"]
    conn.ensure_connection()
    # B: completed with its own response
    b = Identity("scope", new_key(), "POST charges/", "same-fingerprint")
    assert store.claim(b, "tok-b", 3600, 60) is CLAIMED
    assert store.complete(b, "tok-b", StoredResponse(201, (), b'{"for":"B"}'), 3600)
    # A: a fresh key, same operation and body as B
    a = Identity("scope", new_key(), "POST charges/", "same-fingerprint")

    main = threading.get_ident()
    main_executed = threading.Event()
    other_executed = threading.Event()
    paused = {"main": False, "other": False}

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if threading.get_ident() == main and not paused["main"]:
            paused["main"] = True
            main_executed.set()
            other_executed.wait(5)
        elif threading.get_ident() != main and not paused["other"]:
            paused["other"] = True
            other_executed.set()
            # let the main thread read its result first
            threading.Event().wait(0.5)
        return result

    seen: dict[str, Any] = {}

    def other() -> None:
        connections["default"] = conn  # share the main thread's connection
        main_executed.wait(5)
        seen["other"] = store.fetch(b)

    conn.inc_thread_sharing()
    try:
        with conn.execute_wrapper(wrapper):
            t = threading.Thread(target=other)
            t.start()
            seen["main"] = store.claim(a, "tok-a", 3600, 60)
            t.join(10)
    finally:
        conn.dec_thread_sharing()
    # The claim of a fresh key must claim it; the other thread must find B.
    assert seen["main"] is CLAIMED, seen["main"]
    assert isinstance(seen["other"], Existing) and seen["other"].response is not None
    assert seen["other"].response.body == b'{"for":"B"}'


@pytest.fixture
def tenant_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute("DROP SCHEMA IF EXISTS review_tenant_a CASCADE")
        cursor.execute("CREATE SCHEMA review_tenant_a")
        cursor.execute(
            f'CREATE TABLE review_tenant_a."{table}" (LIKE public."{table}" INCLUDING ALL)'
        )
    real = connections["default"]
    base_class = type(real)

    class TenantWrapper(base_class):  # type: ignore[misc,valid-type]
        """django-tenants' way: the schema set on every cursor made."""

        schema = "public"

        def _cursor(self, name: Any = None) -> Any:
            cursor = super()._cursor(name)
            with self.wrap_database_errors:
                raw = self.connection.cursor()
                raw.execute(f"SET search_path = {self.schema}, public")
                raw.close()
            return cursor

    monkeypatch.setattr(real, "__class__", TenantWrapper)
    try:
        yield real
    finally:
        monkeypatch.undo()
        connection.close()
        with connection.cursor() as cursor:
            cursor.execute("DROP SCHEMA IF EXISTS review_tenant_a CASCADE")
        connection.close()


@pytest.mark.postgresql
def test_a_key_of_one_tenant_is_not_replayed_to_another(
    api: APIClient, tenant_backend: Any
) -> None:
    key = new_key()
    tenant_backend.schema = "review_tenant_a"
    first = post(api, "/charges/", BODY, key)
    assert first.status_code == 201
    assert first.headers.get("Idempotent-Replayed") != "true"
    # the next request is the public tenant's: its own records table
    tenant_backend.schema = "public"
    other = post(api, "/charges/", BODY, key)
    assert other.status_code == 201
    assert other.headers.get("Idempotent-Replayed") != "true", "tenant A's response replayed"
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT count(*) FROM public."{IdempotencyRecord._meta.db_table}" WHERE key = %s',
            [key],
        )
        assert cursor.fetchone()[0] == 1


def test_a_statement_a_wrapper_refused_is_not_logged_as_the_previous_one() -> None:
    store = backend("default")
    ident = Identity("scope", new_key(), "POST charges/", "fp")

    def refuse_renewals(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "locked_until" in sql and sql.lstrip().upper().startswith("UPDATE"):
            raise DatabaseError("refused by the wrapper")
        return execute(sql, params, many, context)

    with CaptureQueriesContext(connection) as log:
        assert store.claim(ident, "tok", 3600, 60) is CLAIMED
        with connection.execute_wrapper(refuse_renewals), pytest.raises(DatabaseError):
            store.renew(ident, "tok", 60)
    claim_sql, refused_sql = log.captured_queries[-2]["sql"], log.captured_queries[-1]["sql"]
    # the refused renewal must not show up as a second claim
    assert refused_sql != claim_sql, refused_sql


@pytest.mark.server_db
def test_a_large_replayed_body_is_not_held_after_the_connection_closed() -> None:
    store = backend("default")
    ident = Identity("scope", new_key(), "POST charges/", "fp")
    body = b"x" * (4 * 1024 * 1024)
    assert store.claim(ident, "tok", 3600, 60) is CLAIMED
    assert store.complete(ident, "tok", StoredResponse(201, (), body), 3600)
    fetched = store.fetch(ident)
    assert fetched is not None and fetched.response is not None
    del fetched
    connection.close()
    kept = vars(connections["default"]).get("_idempotency_statement_cursor")
    held = 0
    if kept is not None:
        cursor = kept[1]
        result = getattr(cursor, "pgresult", None)
        if result is not None and result.ntuples:
            held = len(result.get_value(0, 8) or b"")
        rows = getattr(cursor, "_rows", None)
        if rows:
            held = max(held, len(rows[0][8] or b""))
    assert held == 0, f"{held} bytes of a replayed body held by a closed connection's cursor"


@pytest.mark.server_db
def test_a_killed_session_under_the_kept_cursor(quiet_api: APIClient) -> None:
    key = new_key()
    assert post(quiet_api, "/charges/", BODY, key).status_code == 201
    end_session(session_id())
    statuses = []
    for _ in range(3):
        r = post(quiet_api, "/charges/", BODY, key)
        statuses.append((r.status_code, r.headers.get("Idempotent-Replayed")))
        if r.status_code >= 500:
            connection.close_if_unusable_or_obsolete()
    assert statuses[-1] == (201, "true"), statuses
    assert Charge.objects.count() == 1


@pytest.mark.server_db
def test_health_checks_with_a_kept_cursor(api: APIClient) -> None:
    conn = connections["default"]
    conn.settings_dict["CONN_HEALTH_CHECKS"] = True
    conn.settings_dict["CONN_MAX_AGE"] = 600
    try:
        key = new_key()
        assert post(api, "/charges/", BODY, key).status_code == 201
        end_session(session_id())
        conn.health_check_done = False  # as at the start of a request
        r = post(api, "/charges/", BODY, key)
        assert r.status_code == 201 and r.headers["Idempotent-Replayed"] == "true"
        assert Charge.objects.count() == 1
    finally:
        conn.settings_dict["CONN_HEALTH_CHECKS"] = False
        conn.settings_dict["CONN_MAX_AGE"] = 0


def test_a_failed_store_statement_does_not_spoil_the_next(api: APIClient) -> None:
    store = backend("default")
    ident = Identity("scope", new_key(), "POST charges/", "fp")
    assert store.claim(ident, "tok", 3600, 60) is CLAIMED
    with pytest.raises(DatabaseError):
        store.execute("SELECT no_such_column FROM idempotency_app_idempotencyrecord", None)
    key = new_key()
    assert post(api, "/charges/", BODY, key).status_code == 201
    r = post(api, "/charges/", BODY, key)
    assert r.headers["Idempotent-Replayed"] == "true"


def test_sweep_and_admin_release_with_a_kept_cursor(api: APIClient) -> None:
    store = backend("default")
    for n in range(5):
        ident = Identity("scope", f"{new_key()}-{n}", "POST charges/", "fp")
        assert store.claim(ident, "tok", 1, 1) is CLAIMED
    IdempotencyRecord.objects.update(
        expires_at="2000-01-01T00:00:00Z", locked_until="2000-01-01T00:00:00Z"
    )
    call_command("sweep_idempotency", verbosity=0)
    assert not IdempotencyRecord.objects.exists()
    connection.close()
    ident = Identity("scope", new_key(), "POST charges/", "fp")
    assert store.claim(ident, "tok", 3600, 60) is CLAIMED
    pk = IdempotencyRecord.objects.get(key=ident.key).pk
    assert store.release_selected([pk]) == 1
    key = new_key()
    assert post(api, "/charges/", BODY, key).status_code == 201
    assert post(api, "/charges/", BODY, key).headers["Idempotent-Replayed"] == "true"


def _completed(body: bytes) -> Identity:
    store = backend("default")
    ident = Identity("scope", new_key(), "POST charges/", "fp-" + body.decode())
    assert store.claim(ident, "tok", 3600, 60) is CLAIMED
    assert store.complete(ident, "tok", StoredResponse(201, (), body), 3600)
    return ident


@pytest.mark.postgresql
def test_store_calls_in_one_pipeline_each_read_their_own_result() -> None:
    store = backend("default")
    a = _completed(b"A")
    b = _completed(b"B")
    fresh = Identity("scope", new_key(), "POST charges/", "fp-fresh")
    connection.ensure_connection()
    with connection.connection.pipeline():
        renewed = store.renew(a, "not-our-token", 60)  # matches no row
        got_b = store.fetch(b)
        claimed = store.claim(fresh, "tok-fresh", 3600, 60)
        got_a = store.fetch(a)
    assert renewed is False
    assert isinstance(got_b, Existing) and got_b.response is not None
    assert got_b.response.body == b"B", got_b
    assert claimed is CLAIMED, claimed
    assert isinstance(got_a, Existing) and got_a.response is not None
    assert got_a.response.body == b"A", got_a


@pytest.mark.postgresql
def test_a_fetch_after_a_claim_in_a_pipeline() -> None:
    store = backend("default")
    a = _completed(b"A")
    fresh = Identity("scope", new_key(), "POST charges/", "fp-fresh")
    connection.ensure_connection()
    with connection.connection.pipeline():
        claimed = store.claim(fresh, "tok-fresh", 3600, 60)
        got_a = store.fetch(a)
    assert claimed is CLAIMED, claimed
    assert isinstance(got_a, Existing) and got_a.response is not None
    assert got_a.response.body == b"A", got_a


@pytest.mark.postgresql
def test_a_fetch_after_a_release_in_a_pipeline() -> None:
    store = backend("default")
    a = _completed(b"A")
    fresh = Identity("scope", new_key(), "POST charges/", "fp-fresh")
    assert store.claim(fresh, "tok-fresh", 3600, 60) is CLAIMED
    connection.ensure_connection()
    with connection.connection.pipeline():
        store.release(fresh, "tok-fresh")
        got_a = store.fetch(a)
    assert isinstance(got_a, Existing) and got_a.response is not None
    assert got_a.response.body == b"A", got_a


@pytest.mark.postgresql
def test_a_claim_after_a_release_in_a_pipeline() -> None:
    store = backend("default")
    released = Identity("scope", new_key(), "POST charges/", "fp-r")
    assert store.claim(released, "tok-r", 3600, 60) is CLAIMED
    fresh = Identity("scope", new_key(), "POST charges/", "fp-fresh")
    connection.ensure_connection()
    with connection.connection.pipeline():
        store.release(released, "tok-r")
        claimed = store.claim(fresh, "tok-fresh", 3600, 60)
    assert claimed is CLAIMED, claimed


@pytest.mark.postgresql
def test_a_claim_after_a_renew_in_a_pipeline() -> None:
    store = backend("default")
    held = Identity("scope", new_key(), "POST charges/", "fp-h")
    assert store.claim(held, "tok-h", 3600, 60) is CLAIMED
    fresh = Identity("scope", new_key(), "POST charges/", "fp-fresh")
    connection.ensure_connection()
    with connection.connection.pipeline():
        store.renew(held, "tok-h", 60)
        claimed = store.claim(fresh, "tok-fresh", 3600, 60)
    assert claimed is CLAIMED, claimed


@pytest.mark.postgresql
def test_two_claims_in_a_pipeline() -> None:
    store = backend("default")
    a = _completed(b"A")
    fresh = Identity("scope", new_key(), "POST charges/", "fp-fresh")
    connection.ensure_connection()
    with connection.connection.pipeline():
        first = store.claim(a, "tok-2", 3600, 60)
        second = store.claim(fresh, "tok-fresh", 3600, 60)
    assert isinstance(first, Existing) and first.response is not None
    assert first.response.body == b"A"
    assert second is CLAIMED, second


@pytest.mark.postgresql
def test_row_counts_in_a_pipeline_are_the_statements_own() -> None:
    store = backend("default")
    held = Identity("scope", new_key(), "POST charges/", "fp-h")
    assert store.claim(held, "tok-h", 3600, 60) is CLAIMED
    connection.ensure_connection()
    with connection.connection.pipeline():
        renewed = store.renew(held, "tok-h", 60)
        not_ours = store.renew(held, "someone-else", 60)
        released = store.release(held, "tok-h")
    assert (renewed, not_ours, released) == (True, False, True)
    assert store.fetch(held) is None
