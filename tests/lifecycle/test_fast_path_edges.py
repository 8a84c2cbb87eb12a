"""The fast paths at their edges (REPLAY_CACHE, the completion sent with the
COMMIT, RELEASE SAVEPOINT held back, server-side binding): short TTLs, a
moved clock, hand-managed transactions, savepoints used out of order,
ATOMIC_REQUESTS, async views. Each test states the guarantee it checks."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction

from idempotency_app import clock, service
from idempotency_app.clock import DatabaseNow
from idempotency_app.exceptions import OutcomeUnknown, WorkRolledBack
from idempotency_app.lifecycle import replays
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity
from tests.conftest import (
    charge_labels as labels,
    new_key,
    once_in,
    operator,
    replay_cache as cached,
)
from tests.savepoints import savepoint
from tests.testapp.models import Charge, Tag

pytestmark = pytest.mark.django_db(transaction=True)

SCOPE = "tests:fast-path-edges"
OP = "tests.fast_path_edges"


once = once_in(SCOPE, OP)


def expired_in_the_database(key: str) -> bool:
    return IdempotencyRecord.objects.filter(key=key, expires_at__lte=DatabaseNow()).exists()


def held_in_memory(key: str) -> bool:
    record = IdempotencyRecord.objects.get(key=key)
    identity = Identity(record.scope, record.key, record.operation, record.fingerprint)
    return replays.get(identity, "default") is not None


# -- REPLAY_CACHE ------------------------------------------------------------------------


def test_replay_cache_counts_a_short_ttl_from_its_put_not_from_the_completion() -> None:
    """The completion's put holds an entry for min(REPLAY_CACHE, ttl) seconds
    counted from the put, which comes after the commit and after every
    on_commit hook. The record's TTL is counted from the completion
    statement. A hook that takes longer than a short TTL leaves the entry
    alive past the record's expiry: an expired key is replayed instead of
    running again (README, 'What each request gets')."""
    key = new_key()

    def work() -> str:
        Charge.objects.create(label="first")
        with transaction.atomic():
            transaction.on_commit(lambda: time.sleep(1.5))  # a slow hook (mail, broker)
        return "first"

    with cached(5):
        assert once(key, work, ttl=1)[0]
        assert expired_in_the_database(key), "the record should have expired by now"
        ran, result = once(key, lambda: Charge.objects.create(label="after expiry").pk, ttl=1)
    assert ran, f"an expired key was replayed from memory ({result!r})"


def test_clock_advance_past_the_ttl_still_replays_from_memory() -> None:
    """docs/guarantees.md: in tests, clock.freeze() and advance() shift the
    database's clock so that a TTL can be passed. REPLAY_CACHE counts on
    time.monotonic(), which advance() does not move: a test that advances
    past the TTL still gets the replay from memory."""
    key = new_key()
    with cached(5), clock.freeze():
        assert once(key, lambda: "first", ttl=3600)[0]
        clock.advance(3601)
        assert expired_in_the_database(key)
        ran, result = once(key, lambda: "second", ttl=3600)
    assert ran, f"past its TTL by the database's clock, the key replayed {result!r} from memory"


@pytest.mark.parametrize(("ttl", "held"), [(59, False), (61.5, True)])
def test_the_expiring_column_decides_what_a_replay_read_holds(ttl: float, held: bool) -> None:
    """A replay read from the database is held only when the record does not
    expire within 60 s (the new ``expiring`` column, text comparison on
    SQLite, MICROSECOND interval on MySQL)."""
    key = new_key()
    with cached(5):
        assert once(key, lambda: "first", ttl=ttl)[0]
        replays.clear()  # forget the completion's put: read it back from the database
        assert once(key, lambda: "second", ttl=ttl) == (False, "first")
        assert held_in_memory(key) is held


def test_admin_release_of_an_interrupted_key_with_replay_cache(user: Any) -> None:
    """An interrupted key answers OutcomeUnknown, never from memory; once an
    operator releases it, the next request runs."""
    key = new_key()

    def ends_its_transaction() -> str:
        Charge.objects.create(label="committed by the driver")
        connection.connection.commit()
        return "never stored"

    with cached(30):
        with pytest.raises(OutcomeUnknown):
            once(key, ends_its_transaction)
        with pytest.raises(OutcomeUnknown):
            once(key, lambda: "retry")
        pk = IdempotencyRecord.objects.get(key=key).pk
        operator(user).post(
            "/admin/idempotency_app/idempotencyrecord/",
            {"action": "release_claims", "_selected_action": [pk]},
        )
        assert not IdempotencyRecord.objects.filter(key=key).exists()
        assert once(key, lambda: "after release") == (True, "after release")
        assert once(key, lambda: "replay") == (False, "after release")


@pytest.mark.server_db
def test_a_duplicate_waiting_for_in_flight_does_not_hold_an_expiring_result() -> None:
    """WAIT_FOR_IN_FLIGHT: the duplicate polls until the first completes,
    then replays; with a TTL under a minute it must not hold the result."""
    from django.db import connections

    key = new_key()
    started = threading.Event()
    results: dict[str, Any] = {}

    def slow() -> str:
        started.set()
        time.sleep(0.5)
        return "first"

    def first() -> None:
        try:
            results["first"] = once(key, slow, ttl=30, wait=2)
        finally:
            connections.close_all()

    with cached(5):
        thread = threading.Thread(target=first)
        thread.start()
        started.wait(5)
        results["second"] = once(key, lambda: "second", ttl=30, wait=2)
        thread.join()
        assert results["first"] == (True, "first")
        assert results["second"] == (False, "first")
        # The first's completion put it (for min(5, 30) s); the waiter's read must not have
        # replaced it with an entry of its own: forget and read again through a waiter path.
        replays.clear()
        assert once(key, lambda: "third", ttl=30) == (False, "first")
        assert not held_in_memory(key)


# -- A transaction managed by hand, on a connection not opened yet ------------------------


@pytest.fixture
def autocommit_off() -> Iterator[None]:
    """DATABASES['default']['AUTOCOMMIT'] = False (Django's 'deactivate
    transaction management'), and a connection not opened yet (the first
    query of a task or request under CONN_MAX_AGE = 0)."""
    connection.close()
    connection.settings_dict["AUTOCOMMIT"] = False
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            connection.rollback()
        connection.close()
        connection.settings_dict["AUTOCOMMIT"] = True


@pytest.mark.server_db
def test_a_hand_managed_transaction_on_a_fresh_connection(autocommit_off: None) -> None:
    """With autocommit off, the caller owns the transaction: claim, work and
    outcome commit or roll back when the caller says (as a NestedClaim does
    once the connection is open). On a connection not opened yet,
    in_transaction() says no transaction, so the claim is an AtomicClaim:
    on PostgreSQL the completion sends a COMMIT of its own (committing the
    caller's transaction mid-way), and with REPLAY_CACHE the completion is
    held in memory before anything committed."""
    key = new_key()
    outcome: Any
    with cached(5):
        try:
            outcome = once(key, lambda: Charge.objects.create(label="first").pk)
        except Exception as exc:
            outcome = exc
        connection.rollback()  # the caller decides: nothing of it is kept
        kept = labels()
        record = list(IdempotencyRecord.objects.filter(key=key).values_list("status", flat=True))
        connection.rollback()
        ran, result = once(key, lambda: Charge.objects.create(label="redelivered").pk)
        connection.rollback()
    assert kept == [], (
        f"the caller rolled back, yet {kept} committed, record {record} (once() answered {outcome!r})"
    )
    assert ran, f"redelivered after a rollback, the key replayed {result!r} from memory"


# -- RELEASE SAVEPOINT held back ---------------------------------------------------------


def _release_then_rollback_to_same() -> Any:
    def work() -> str:
        Charge.objects.create(label="kept")
        sid = savepoint()
        Charge.objects.create(label="inside sid")
        transaction.savepoint_commit(sid)
        try:
            transaction.savepoint_rollback(sid)  # released already: the server refuses
        except DatabaseError:
            return "the rollback failed"
        return "rolled back"

    return work


def _release_outer_then_rollback_to_inner() -> Any:
    def work() -> str:
        Charge.objects.create(label="kept")
        outer = savepoint()
        Charge.objects.create(label="inside outer")
        inner = savepoint()
        Charge.objects.create(label="inside inner")
        transaction.savepoint_commit(outer)  # releases inner too
        try:
            transaction.savepoint_rollback(inner)
        except DatabaseError:
            return "the rollback failed"
        return "rolled back"

    return work


class _Undo(Exception):
    pass


@pytest.mark.parametrize(
    "make_work", [_release_then_rollback_to_same, _release_outer_then_rollback_to_inner]
)
def test_a_rollback_to_a_savepoint_already_released(make_work: Any) -> None:
    """'Releasing late changes nothing a statement can see' (docs). A
    ROLLBACK TO a savepoint that a RELEASE destroyed fails on the server;
    with that RELEASE held back (and dropped by the ROLLBACK TO), it
    succeeds: the work sees its rollback succeed where the same code without
    a key fails, and a success is stored for the partly undone work."""
    work = make_work()
    vanilla: Any = None
    with contextlib.suppress(_Undo, DatabaseError), transaction.atomic():
        vanilla = work()
        raise _Undo
    Charge.objects.all().delete()
    assert vanilla == "the rollback failed"  # what the server says without the library
    try:
        outcome: Any = once(new_key(), work)
    except (WorkRolledBack, DatabaseError) as exc:
        outcome = exc
    assert outcome != (True, "rolled back"), (
        f"under a key the rollback to a released savepoint succeeded; committed {labels()}"
    )


def test_a_held_release_then_a_failing_statement_in_an_outer_block_caught() -> None:
    """A held RELEASE goes in front of a statement that fails inside an
    enclosing block; the work catches it, the block rolls back, and the
    work carries on. The same rows as without a key."""
    Tag.objects.create(name="taken")

    def work() -> str:
        Charge.objects.create(label="before")
        with transaction.atomic():
            with transaction.atomic():
                Charge.objects.create(label="inner, undone with the outer block")
            with contextlib.suppress(IntegrityError):
                Tag.objects.create(name="taken")  # fails: the outer block is doomed
        Charge.objects.create(label="after")
        with transaction.atomic():
            Charge.objects.create(label="last")
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["after", "before", "last"]


@pytest.mark.server_db
def test_select_for_update_nowait_failing_inside_a_block() -> None:
    """A row locked by another connection: the block's NOWAIT fails, the work
    catches it and carries on; the block is undone, the rest stored."""
    from django.db import OperationalError, connections

    locked_pk = Charge.objects.create(label="locked").pk
    locked, done = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                Charge.objects.select_for_update().get(pk=locked_pk)
                locked.set()
                done.wait(10)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    assert locked.wait(5)

    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="before")
        try:
            with transaction.atomic():
                Charge.objects.create(label="inside, undone")
                list(Charge.objects.select_for_update(nowait=True).filter(pk=locked_pk))
        except (OperationalError, DatabaseError):
            pass
        Charge.objects.create(label="after")
        return "done"

    try:
        assert once(new_key(), work) == (True, "done")
    finally:
        done.set()
        thread.join()
    assert labels() == ["after", "before", "locked"]


def test_complete_many_then_a_replay_read_holds_only_what_is_not_expiring() -> None:
    """complete_many stores nothing in memory; a later replay read does,
    unless the record expires within a minute."""
    keys = [new_key(), new_key()]
    with cached(5):
        held = [
            service.claim(SCOPE, keys[0], OP, ttl=3600),
            service.claim(SCOPE, keys[1], OP, ttl=30),
        ]
        with transaction.atomic():
            assert service.complete_many([(held[0], "a"), (held[1], "b")]) == ["a", "b"]
        assert not held_in_memory(keys[0]) and not held_in_memory(keys[1])
        assert isinstance(service.claim(SCOPE, keys[0], OP), service.Done)
        assert isinstance(service.claim(SCOPE, keys[1], OP), service.Done)
        assert held_in_memory(keys[0]) and not held_in_memory(keys[1])


# -- TTL edge values -----------------------------------------------------------------------


def test_a_per_call_ttl_beyond_the_databases_calendar() -> None:
    """Per-call TTLs need only be positive and finite (policy_problems). One
    past year 9999 cannot be stored by SQLite's strftime or MySQL's DATETIME:
    the claim then fails as if the database were down (503
    idempotency_store_unavailable) rather than as a configuration error."""
    from django.core.exceptions import ImproperlyConfigured

    from idempotency_app.exceptions import StoreUnavailable

    try:
        outcome: Any = once(new_key(), lambda: "ran", ttl=1e12)
    except (ImproperlyConfigured, ValueError) as exc:
        outcome = exc  # refused as a configuration error: fine
    except StoreUnavailable as exc:
        pytest.fail(f"a 31,700-year TTL was answered as an outage: {exc}")
    assert outcome == (True, "ran") or isinstance(outcome, ImproperlyConfigured | ValueError)


# -- PostgreSQL: server-side binding on every store statement, and errors at the completion ----


@pytest.fixture
def pg_options(request: Any) -> Iterator[dict[str, Any]]:
    options = request.param
    saved = dict(connection.settings_dict.get("OPTIONS", {}))
    connection.close()
    connection.settings_dict["OPTIONS"] = {**saved, **options}
    connection.features.__dict__.pop("uses_server_side_binding", None)
    try:
        yield options
    finally:
        connection.close()
        connection.settings_dict["OPTIONS"] = saved
        connection.features.__dict__.pop("uses_server_side_binding", None)


@pytest.mark.postgresql
@pytest.mark.parametrize(
    "pg_options",
    [{"server_side_binding": True}, {"server_side_binding": True, "prepare_threshold": 0}],
    indirect=True,
    ids=str,
)
def test_every_store_statement_under_server_side_binding(pg_options: Any, user: Any) -> None:
    """adapt() readies the store's cursors for server-side binding: the
    takeover of an expired record, renew, interrupt, release, the sweep and
    the admin's actions must all work, with REPLAY_CACHE on."""
    from django.core.management import call_command

    key = new_key()
    with cached(5):

        def renewing() -> str:
            with service.once(SCOPE, "inner-" + key, OP) as inner:
                assert inner.renew(), "renew refused"
                inner.result = "inner"
            Charge.objects.create(label="first")
            return "first"

        assert once(key, renewing, ttl=1) == (True, "first")
        time.sleep(1.2)
        replays.clear()
        assert once(key, lambda: "taken over", ttl=1) == (True, "taken over")
        held = service.claim(SCOPE, new_key(), OP)
        assert service.release(held)

        def ends_its_transaction() -> None:
            Charge.objects.create(label="committed by the driver")
            connection.connection.commit()

        with pytest.raises(OutcomeUnknown):
            once(new_key(), ends_its_transaction)
        time.sleep(1.2)
        call_command("sweep_idempotency", verbosity=0)
        assert not IdempotencyRecord.objects.filter(key=key).exists()
        done = new_key()
        assert once(done, lambda: "x") == (True, "x")
        pk = IdempotencyRecord.objects.get(key=done).pk
        operator(user).post(
            "/admin/idempotency_app/idempotencyrecord/",
            {"action": "expire_records", "_selected_action": [pk], "post": "yes"},
        )
        assert expired_in_the_database(done)
        assert once(done, lambda: "y") == (True, "y")


@pytest.mark.postgresql
def test_a_deadlock_at_the_completion_is_a_rollback_while_the_claim_is_ours() -> None:
    """On PostgreSQL the completion and the COMMIT are one message, and the
    error does not say which met it: the record read back decides. Still
    ours: a rollback (500 request_rolled_back), nothing committed, and the
    key released so a retry runs (docs/decisions.md). A trigger on the
    records' table stands in for the lock cycle."""
    from idempotency_app.exceptions import ClaimLost

    table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE OR REPLACE FUNCTION deadlock_on_complete() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN IF NEW.status = 'completed' AND NEW.scope = "
            f"'{SCOPE}' THEN RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01'; "
            "END IF; RETURN NEW; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER deadlock_on_complete BEFORE UPDATE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION deadlock_on_complete()"
        )
    try:
        with pytest.raises((ClaimLost, WorkRolledBack)) as caught:
            once(new_key(), lambda: Charge.objects.create(label="x").pk)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS deadlock_on_complete ON {table}")
            cursor.execute("DROP FUNCTION IF EXISTS deadlock_on_complete()")
    assert labels() == []
    assert isinstance(caught.value, WorkRolledBack), type(caught.value).__name__
    assert not isinstance(caught.value, ClaimLost)


# -- ATOMIC_REQUESTS and async views, with REPLAY_CACHE ---------------------------------------


@pytest.fixture
def atomic_requests() -> Iterator[None]:
    connection.settings_dict["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        connection.settings_dict["ATOMIC_REQUESTS"] = False


def test_atomic_requests_never_fill_the_replay_cache(api: Any, atomic_requests: None) -> None:
    """Under ATOMIC_REQUESTS every claim is nested: neither the completion
    nor a replay read inside the request's transaction may be held."""
    from tests.conftest import post

    key = new_key()
    with cached(5):
        first = post(api, "/charges/", {"label": "a", "amount": 5}, key)
        assert first.status_code == 201
        assert not held_in_memory(key)
        again = post(api, "/charges/", {"label": "a", "amount": 5}, key)
        assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
        assert not held_in_memory(key)
        assert again.content == first.content
    assert Charge.objects.count() == 1


def test_async_view_replays_from_memory_until_the_admin_expires(api: Any, user: Any) -> None:
    pytest.importorskip("adrf")
    from tests.conftest import post

    key = new_key()
    with cached(30):
        first = post(api, "/async/charges/", {"label": "a", "amount": 5}, key)
        assert first.status_code == 201, first.content
        assert held_in_memory(key)
        again = post(api, "/async/charges/", {"label": "a", "amount": 5}, key)
        assert again.content == first.content and again["Idempotent-Replayed"] == "true"
        pk = IdempotencyRecord.objects.get(key=key).pk
        operator(user).post(
            "/admin/idempotency_app/idempotencyrecord/",
            {"action": "expire_records", "_selected_action": [pk], "post": "yes"},
        )
        third = post(api, "/async/charges/", {"label": "a", "amount": 5}, key)
        assert third.status_code == 201 and "Idempotent-Replayed" not in third
    assert Charge.objects.count() == 2
