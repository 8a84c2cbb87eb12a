"""Attacks on the claim as a PL/pgSQL function (migration 0007) must behave
exactly as the claim statement, and the one-time lookup must never change
what a claim decides."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction

from idempotency_app import clock, service
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import backend, postgresql
from idempotency_app.store.base import CLAIMED, Existing, Identity, StoredResponse
from tests.concurrency import in_threads
from tests.conftest import end_session

pytestmark = [pytest.mark.postgresql, pytest.mark.django_db(transaction=True)]

FORMS = ["function", "statement"]


def store(form: str, using: str = "default") -> postgresql.Backend:
    s = postgresql.Backend(using)
    s.claims_by_function = form == "function"
    return s


def odd_identities(key: str) -> list[Identity]:
    u = key[:8]
    return [
        Identity("t'en\\ant %s %(key)s %%", f"k'\\%(scope)s%s;--{u}", "op'%s", "fp\\"),
        Identity("\U0001f600" * 200, f"\u00e9\U0001d11e{u}", "\u00fcop", "fp"),
        Identity("s" * 255, ("k" * 247) + u, "o" * 255, "f" * 64),
        Identity("tenant", u + " " * 247, "op", "fp"),  # 255 chars, trailing spaces
        Identity("tenant", f"{u}$body$ $$ E'\\x00'", "op", "fp"),
    ]


@pytest.mark.parametrize("first", FORMS)
@pytest.mark.parametrize("in_transaction", [False, True])
def test_odd_inputs_claim_and_read_back_alike(first: str, in_transaction: bool, key: str) -> None:
    """Claimed by one form, met by the other: the same record, stored exactly."""
    second = "statement" if first == "function" else "function"
    for identity in odd_identities(key):
        with transaction.atomic() if in_transaction else connection.cursor():
            assert store(first).claim(identity, "t1", 60, 30) is CLAIMED
            met_a = store(second).claim(identity, "t2", 60, 30)
            met_b = store(first).claim(identity, "t3", 60, 30)
        assert isinstance(met_a, Existing) and met_a == met_b, (met_a, met_b)
        assert met_a.token == "t1" and met_a.matches(identity)
        row = IdempotencyRecord.objects.get(scope=identity.scope, key=identity.key)
        assert (row.operation, row.fingerprint, row.token) == (
            identity.operation,
            identity.fingerprint,
            "t1",
        )


@pytest.mark.parametrize(
    "options",
    [{}, {"prepare_threshold": 0}, {"server_side_binding": True}],
    ids=["client", "prepared", "server-binding"],
)
def test_the_function_under_every_binding(options: dict[str, Any], key: str) -> None:
    """Prepared (psycopg's prepare_threshold) and server-side binding: the
    function's call must resolve and decide alike, alone and in a transaction."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(connection.settings_dict, "OPTIONS", dict(options))
        connection.close()
        try:
            s = postgresql.Backend("default")  # asks the catalog itself
            for n in range(4):  # past prepare thresholds
                for identity in odd_identities(f"{key[:6]}{n}{key[7:]}"):
                    assert s.claim(identity, "t1", 60, 30) is CLAIMED
                    with transaction.atomic():
                        found = s.claim(identity, "t2", 60, 30)
                    assert isinstance(found, Existing) and found.token == "t1"
            assert s.claims_by_function is True
        finally:
            connection.close()


@pytest.mark.parametrize("lookup", [True, None], ids=["known", "asked-concurrently"])
def test_many_threads_claiming_one_key(lookup: bool | None, key: str) -> None:
    s = postgresql.Backend("default")
    s.claims_by_function = lookup
    identity = Identity("tenant", key, "op", "fp")
    tokens = [f"tok{i}" for i in range(12)]
    counter = iter(range(12))
    lock = threading.Lock()

    def one() -> Any:
        with lock:
            n = next(counter)
        return tokens[n], s.claim(identity, tokens[n], 60, 30)

    results = in_threads(12, one)
    assert not [r for r in results if isinstance(r, Exception)], results
    winners = [t for t, r in results if r is CLAIMED]
    assert len(winners) == 1, results
    others = [r for _, r in results if r is not CLAIMED]
    assert all(isinstance(r, Existing) and r.token == winners[0] for r in others), results
    assert s.claims_by_function is True
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


def _wait_until_blocked(pid: int) -> None:
    deadline = time.monotonic() + 10
    with connections["default"].cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
            row = cursor.fetchone()
            if row and row[0] == "Lock":
                return
            time.sleep(0.02)
    raise AssertionError("the second claim never waited on the first")


def _race_to_an_invisible_row(form: str, isolation: str | None, key: str) -> Any:
    """A holds the key in an open transaction; B's claim waits on it; A
    commits. B's statement snapshot cannot see A's row."""
    identity = Identity("tenant", key, "op", "fp")
    a_claimed, b_pid, a_may_commit = threading.Event(), [], threading.Event()
    outcome: list[Any] = []
    fetched: list[bool] = []
    s = store(form)
    real_fetch = s.fetch

    def spying_fetch(ident: Identity, connection: Any = None) -> Any:
        fetched.append(True)
        return real_fetch(ident, connection)

    s.fetch = spying_fetch  # type: ignore[method-assign]

    def a() -> None:
        try:
            with transaction.atomic():
                assert s.claim(identity, "A", 60, 30) is CLAIMED
                a_claimed.set()
                assert a_may_commit.wait(20)
        finally:
            connections.close_all()

    def b() -> None:
        try:
            assert a_claimed.wait(20)
            conn = connections["default"]
            conn.ensure_connection()
            b_pid.append(conn.connection.info.backend_pid)
            if isolation:
                with transaction.atomic():
                    with conn.cursor() as cursor:
                        cursor.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
                        cursor.execute("SELECT 1")  # snapshot taken here
                    outcome.append(s.claim(identity, "B", 60, 30))
            else:
                outcome.append(s.claim(identity, "B", 60, 30))
        except Exception as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    try:
        deadline = time.monotonic() + 20
        while not b_pid and time.monotonic() < deadline:
            time.sleep(0.01)
        _wait_until_blocked(b_pid[0])
    finally:
        a_may_commit.set()
        ta.join(30)
        tb.join(30)
    return outcome[0], bool(fetched)


@pytest.mark.parametrize("isolation", [None, "READ COMMITTED"])
def test_losing_the_race_to_a_row_the_snapshot_cannot_see(isolation: str | None, key: str) -> None:
    results = {form: _race_to_an_invisible_row(form, isolation, f"{key}-{form}") for form in FORMS}
    for form, (found, _fetched) in results.items():
        assert isinstance(found, Existing) and found.token == "A", (form, found)
    assert results["function"][1] == results["statement"][1], results


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_the_race_at_a_stricter_isolation_fails_alike(isolation: str, key: str) -> None:
    results = {
        form: _race_to_an_invisible_row(form, isolation, f"{key}-{form}")[0] for form in FORMS
    }

    def shape(x: Any) -> Any:
        if isinstance(x, Exception):
            cause = x.__cause__ or x
            return type(x).__name__, getattr(cause, "sqlstate", None)
        return x.token if isinstance(x, Existing) else x

    assert shape(results["function"]) == shape(results["statement"]), results


def test_lapsed_and_expired_records_are_taken_over(key: str) -> None:
    scope, op = "attack:takeover", "op"
    with clock.freeze():
        first = service.claim(scope, key, op, lease=30, ttl=60)
        assert isinstance(first, service.Held)
        with pytest.raises(service.KeyInProgress):
            service.claim(scope, key, op, lease=30, ttl=60, wait=0)
        clock.advance(31)
        second = service.claim(scope, key, op, lease=30, ttl=60)
        assert isinstance(second, service.Held)
        with pytest.raises(service.ClaimLost):
            service.complete(first, {"n": 1})
        assert service.complete(second, {"n": 2}) == {"n": 2}
        done = service.claim(scope, key, op, lease=30, ttl=60)
        assert isinstance(done, service.Done) and done.result == {"n": 2}
        clock.advance(61)
        third = service.claim(scope, key, op, lease=30, ttl=60)
        assert isinstance(third, service.Held)
    assert backend("default").claims_by_function is True


def _show() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0])


def test_a_first_claim_inside_atomic_leaves_the_commit_synchronous(key: str) -> None:
    """The thread's connection does not exist yet; the claim is its first query."""
    s = postgresql.Backend("default")

    def body() -> Any:
        assert connection.connection is None
        with transaction.atomic():
            assert s.claim(Identity("tenant", key, "op", "fp"), "t", 60, 30) is CLAIMED
            return _show()

    assert in_threads(1, body) == ["on"]


def test_settings_autocommit_off_keeps_the_commit_synchronous(key: str) -> None:
    s = store("function")

    def body() -> Any:
        assert connection.connection is None
        assert s.claim(Identity("tenant", key, "op", "fp"), "t", 60, 30) is CLAIMED
        value = _show()
        connection.rollback()
        return value

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(connection.settings_dict, "AUTOCOMMIT", False)
        assert in_threads(1, body) == ["on"]


def test_a_claim_alone_leaves_the_session_synchronous(key: str) -> None:
    s = store("function")
    assert s.claim(Identity("tenant", key, "op", "fp"), "t", 60, 30) is CLAIMED
    assert _show() == "on"
    with transaction.atomic():
        assert _show() == "on"


@pytest.fixture
def tenant_schema() -> Iterator[str]:
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute("DROP SCHEMA IF EXISTS tenant_schema_t CASCADE")
        cursor.execute("CREATE SCHEMA tenant_schema_t")
        cursor.execute(
            f'CREATE TABLE tenant_schema_t."{table}" (LIKE public."{table}" INCLUDING ALL)'
        )
    try:
        yield "tenant_schema_t"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET search_path")
            cursor.execute("DROP SCHEMA IF EXISTS tenant_schema_t CASCADE")
        connection.close()


def test_a_session_switching_search_path_claims_in_each_schema(
    tenant_schema: str, key: str
) -> None:
    """Schema per tenant, the function in public only: the function's cached
    (generic, after 5 calls) plan must follow the session's search_path."""
    s = postgresql.Backend("default")
    table = IdempotencyRecord._meta.db_table
    for n in range(8):
        identity = Identity("tenant", f"{key}-{n}", "op", "fp")
        for path in (f"{tenant_schema}, public", "public"):
            with connection.cursor() as cursor:
                cursor.execute(f"SET search_path TO {path}")
            assert s.claim(identity, "t", 60, 30) is CLAIMED, (n, path)
            assert isinstance(s.claim(identity, "u", 60, 30), Existing)
    assert s.claims_by_function is True
    with connection.cursor() as cursor:
        cursor.execute(
            f'SELECT count(*) FROM {tenant_schema}."{table}" WHERE key LIKE %s', [f"{key}-%"]
        )
        assert cursor.fetchone() == (8,)
        cursor.execute(f'SELECT count(*) FROM public."{table}" WHERE key LIKE %s', [f"{key}-%"])
        assert cursor.fetchone() == (8,)


@pytest.mark.parametrize("prepare", [None, 0], ids=["text", "prepared"])
@pytest.mark.parametrize("noticed", [False, True], ids=["unnoticed", "already-failed"])
def test_a_broken_connection_at_the_first_claim_is_replaced(
    prepare: int | None, noticed: bool, key: str
) -> None:
    """The lookup meets a dead connection: the claim must still reconnect
    once (docs/operations.md), not escape as a driver error."""
    options = {} if prepare is None else {"prepare_threshold": prepare}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(connection.settings_dict, "OPTIONS", options)
        patch.setattr(backend("default"), "claims_by_function", None)
        connection.close()
        try:
            connection.ensure_connection()
            end_session(connection.connection.info.backend_pid)
            time.sleep(0.2)
            if noticed:
                with pytest.raises(DatabaseError), connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
            held = service.claim("attack:conn", key, "op")
            assert isinstance(held, service.Held)
            service.complete(held, {"ok": 1})
            assert backend("default").claims_by_function is True
        finally:
            connection.close()


def test_the_function_dropped_under_a_running_process_heals(
    function_dropped: postgresql.Backend, key: str
) -> None:
    """A migration back to 0006 under a running process: a claim alone
    meets the missing function in a transaction of its own, which nothing
    else shared, so it claims with the statement at once; the process sends
    the statement from then on."""
    assert isinstance(service.claim("attack:drop", key, "op"), service.Held)
    assert function_dropped.claims_by_function is False
    assert IdempotencyRecord.objects.filter(key=key).count() == 1


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_second_alias_asks_for_itself(key: str) -> None:
    s = postgresql.Backend("other")
    identity = Identity("tenant", key, "op", "fp")
    assert s.claim(identity, "t", 60, 30) is CLAIMED
    with transaction.atomic(using="other"):
        found = s.claim(identity, "u", 60, 30)
    assert isinstance(found, Existing) and found.token == "t"
    assert s.claims_by_function is True


def test_a_completed_record_replays_through_the_function(key: str) -> None:
    s = store("function")
    identity = Identity("tenant", key, "op", "fp")
    assert s.claim(identity, "t", 60, 30) is CLAIMED
    response = StoredResponse(201, (("X-A", "%s '\\ \u00e9"),), bytes(range(256)))
    assert s.complete(identity, "t", response, 60)
    found = s.claim(identity, "u", 60, 30)
    assert isinstance(found, Existing) and found.response == response
    assert found == store("statement").claim(identity, "v", 60, 30)
