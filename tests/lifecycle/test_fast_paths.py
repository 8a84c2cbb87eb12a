"""The fast paths against what tries hardest to break them: the completion
sent with the COMMIT, savepoints sent with the next statement, prepared
claims and replays from memory.

Each test keeps a guarantee: the work's writes and the stored outcome
commit together or not at all, never two committed executions, no replay
of the wrong or a stale response, and the right error for what happened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction

from idempotency_app import signals
from idempotency_app.exceptions import ClaimLost, WorkRolledBack
from idempotency_app.lifecycle import replays
from idempotency_app.lifecycle.claims import Claim
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels, new_key, once_in, replay_cache as cached
from tests.savepoints import savepoint
from tests.testapp.models import Charge, LedgerEntry, Tag

pytestmark = pytest.mark.django_db(transaction=True)

SCOPE = "tests:fast-paths"
OP = "tests.fast_paths"

postgresql_only = pytest.mark.postgresql


once = once_in(SCOPE, OP)


# -- REPLAY_CACHE --------------------------------------------------------------------


def test_replay_cache_holds_a_replay_of_an_uncommitted_completion() -> None:
    """A consumer handles a batch of events in one transaction (nested mode);
    the batch holds the same event twice, so the second copy is a replay of
    the first copy's completion, which is not committed yet. The batch then
    fails and rolls back: the event's work never committed. Redelivered, the
    event must run; the process must not answer it from memory with the
    result of work that rolled back (guarantee 1)."""
    key = new_key()
    with cached():
        with pytest.raises(RuntimeError), transaction.atomic():
            ran, _ = once(key, lambda: Charge.objects.create(label="event").pk)
            assert ran
            ran_again, _ = once(key, lambda: Charge.objects.create(label="dup").pk)
            assert not ran_again  # a replay of the first copy, inside the batch
            raise RuntimeError("the batch fails: everything rolls back")
        assert Charge.objects.count() == 0
        assert not IdempotencyRecord.objects.filter(key=key).exists()
        # The redelivery, in the same process, within REPLAY_CACHE seconds.
        ran, result = once(key, lambda: Charge.objects.create(label="redelivered").pk)
    assert ran, f"replayed {result!r} from memory for work that rolled back"
    assert labels() == ["redelivered"]


def test_replay_cache_outlives_the_records_ttl() -> None:
    """A key expires after its TTL, and the next request with it runs again
    (README, 'What each request gets'). With REPLAY_CACHE longer than a
    per-call TTL, the process keeps replaying the expired record."""
    key = new_key()
    with cached(5):
        ran, _ = once(key, lambda: Charge.objects.create(label="first").pk, ttl=1)
        assert ran
        time.sleep(1.5)  # the record has expired by the database's clock
        assert IdempotencyRecord.objects.get(key=key).expires_at < _now()
        ran, _ = once(key, lambda: Charge.objects.create(label="after expiry").pk, ttl=1)
    assert ran, "an expired key was replayed from memory instead of running again"
    assert labels() == ["after expiry", "first"]


def test_replay_cache_refilled_by_a_replay_racing_the_admins_expire(user: Any) -> None:
    """The process that expires a record forgets at once (docs/performance.md).
    A replay read from the database just before the expire commits, and put
    in memory just after the clear, brings the expired record back in that
    very process for another REPLAY_CACHE seconds."""
    from tests.conftest import operator, replay_cache as cached

    key = new_key()
    admin = operator(user)
    with cached(30):
        assert once(key, lambda: Charge.objects.create(label="first").pk)[0]
        replays.clear()  # this worker thread has not seen it yet

        def expire_meanwhile(sender: Any, identity: Any, **kwargs: Any) -> None:
            # Another thread of the same process: the operator's expire,
            # committed between the replay's read and its put.
            pk = IdempotencyRecord.objects.get(key=key).pk
            thread = threading.Thread(
                target=lambda: admin.post(
                    "/admin/idempotency_app/idempotencyrecord/",
                    {"action": "expire_records", "_selected_action": [pk], "post": "yes"},
                )
            )
            thread.start()
            thread.join()

        signals.replayed.connect(expire_meanwhile, sender=Claim, weak=False)
        try:
            assert not once(key, lambda: Charge.objects.create(label="dup").pk)[0]
        finally:
            signals.replayed.disconnect(expire_meanwhile, sender=Claim)
        assert IdempotencyRecord.objects.get(key=key).expires_at <= _now()
        ran, _ = once(key, lambda: Charge.objects.create(label="after expire").pk)
    assert ran, "the process that expired the key replayed it from memory"


def _now() -> Any:
    from django.utils import timezone

    return timezone.now()


# -- The completion sent with the COMMIT --------------------------------------------


@postgresql_only
def test_a_deferred_foreign_key_violation_at_commit_is_not_stored() -> None:
    """On PostgreSQL Django's foreign keys are DEFERRABLE INITIALLY DEFERRED:
    the violation surfaces at the COMMIT, which now travels with the
    completion. The work must be reported rolled back and the key released."""
    key = new_key()

    def work() -> str:
        Charge.objects.create(label="orphaned ledger")
        LedgerEntry.objects.create(charge_id=10**9, amount=1)
        return "done"

    with pytest.raises((WorkRolledBack, IntegrityError)) as caught:
        once(key, work)
    assert isinstance(caught.value, WorkRolledBack), caught.value
    assert labels() == []
    assert not IdempotencyRecord.objects.filter(
        key=key, status=IdempotencyRecord.Status.COMPLETED
    ).exists()
    # The key was let go: a retry runs.
    assert once(key, lambda: "again") == (True, "again")


@pytest.fixture
def commit_time_failure() -> Iterator[Any]:
    """A deferred constraint trigger on Charge that fails the COMMIT with the
    SQLSTATE asked for when a charge labelled ``fail:<sqlstate>`` was
    written: what PostgreSQL's SERIALIZABLE does at COMMIT (40001, a
    read/write dependency found only then) or a deadlock (40P01)."""
    table = connection.ops.quote_name(Charge._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE OR REPLACE FUNCTION fail_at_commit() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.label LIKE 'fail:%' THEN "
            "RAISE EXCEPTION 'failing the commit' USING ERRCODE = substr(NEW.label, 6); "
            "END IF; RETURN NULL; END $$"
        )
        cursor.execute(
            f"CREATE CONSTRAINT TRIGGER fail_at_commit AFTER INSERT ON {table} "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_at_commit()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS fail_at_commit ON {table}")
            cursor.execute("DROP FUNCTION IF EXISTS fail_at_commit()")


@postgresql_only
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"])
def test_a_serialization_failure_at_the_commit_is_a_rollback_not_a_lost_claim(
    commit_time_failure: Any, sqlstate: str
) -> None:
    """docs/decisions.md: 'A serialization failure or deadlock is the
    work's, not the database's. While completing it is a lost claim (409,
    ClaimLost), at the commit a rollback (500 request_rolled_back,
    WorkRolledBack)'. Once the COMMIT travels with the completion, an error
    raised by the COMMIT itself must still be read as the commit's."""
    key = new_key()
    with pytest.raises((WorkRolledBack, ClaimLost)) as caught:
        once(key, lambda: Charge.objects.create(label=f"fail:{sqlstate}").pk)
    assert labels() == []
    assert isinstance(caught.value, WorkRolledBack), (
        f"a COMMIT that failed with {sqlstate} was reported as {type(caught.value).__name__}"
    )


# -- Savepoints held back -------------------------------------------------------------


def test_a_user_execute_wrapper_that_raises_after_the_statement_ran() -> None:
    """A wrapper the view installs (inside the library's guard) runs the
    statement, then raises: a query budget, an N+1 detector. The SAVEPOINT
    went out with that statement; the held list must not believe otherwise,
    or the block's ROLLBACK TO is swallowed and its writes commit."""

    def after_the_fact(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if "INSERT" in str(sql):
            raise RuntimeError("query budget exceeded")
        return result

    def work() -> str:
        Charge.objects.create(label="kept")
        try:
            with transaction.atomic(), connection.execute_wrapper(after_the_fact):
                Charge.objects.create(label="inside a block that rolled back")
        except RuntimeError:
            pass
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["kept"]


@postgresql_only
def test_a_cursor_class_named_at_the_call_inside_a_block_that_rolls_back() -> None:
    """SQL through a cursor class named at the call is not judged (docs,
    'Not guarded' 3), but it used to run inside the block's savepoint, so
    the block's rollback undid it. With the SAVEPOINT held back, the write
    happens before any savepoint and the ROLLBACK TO is never sent."""
    import psycopg

    table = connection.ops.quote_name(Charge._meta.db_table)

    def work() -> str:
        Charge.objects.create(label="kept")
        try:
            with transaction.atomic():
                cursor = psycopg.ClientCursor(connection.connection)
                cursor.execute(
                    f"INSERT INTO {table} (label, amount) VALUES ('undone by the block', 0)"
                )
                raise ValueError("roll the block back")
        except ValueError:
            pass
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["kept"]


@postgresql_only
def test_psycopg_pipeline_mode_inside_a_block() -> None:
    """psycopg's pipeline mode sends every statement with the extended
    protocol, which takes one statement per message: a SAVEPOINT prepended
    to the view's statement fails where the undecorated view works."""

    def work() -> str:
        with transaction.atomic(), connection.connection.pipeline():
            Charge.objects.create(label="piped")
        return "done"

    # The same work, undecorated, works.
    work()
    Charge.objects.all().delete()
    assert once(new_key(), work) == (True, "done")
    assert labels() == ["piped"]


@postgresql_only
def test_savepoint_rolled_back_after_a_statement_in_a_server_side_cursor() -> None:
    """``.iterator()`` runs on a server-side cursor (a DECLARE), which cannot
    carry the held SAVEPOINT: it must be flushed before it."""
    Charge.objects.create(label="existing")

    def work() -> str:
        try:
            with transaction.atomic():
                for charge in Charge.objects.all().iterator(chunk_size=1):
                    Charge.objects.filter(pk=charge.pk).update(label="renamed, undone")
                raise ValueError("roll the block back")
        except ValueError:
            pass
        Charge.objects.create(label="after")
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["after", "existing"]


@postgresql_only
def test_composed_and_bytes_sql_inside_a_failing_block() -> None:
    from psycopg import sql as pgsql

    table = Charge._meta.db_table
    Tag.objects.create(name="taken")

    def work() -> str:
        for i, statement in enumerate(
            [
                pgsql.SQL("INSERT INTO {} (label, amount) VALUES ({}, 0)").format(
                    pgsql.Identifier(table), pgsql.Literal("composed, undone")
                ),
                f"INSERT INTO {table} (label, amount) VALUES ('bytes, undone', 0)".encode(),
            ]
        ):
            try:
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute(statement)
                    Tag.objects.create(name="taken")
            except IntegrityError:
                Charge.objects.create(label=f"after {i}")
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["after 0", "after 1"]


def test_nested_once_inside_the_work_whose_inner_block_fails() -> None:
    Tag.objects.create(name="taken")

    def inner() -> str:
        try:
            with transaction.atomic():
                Charge.objects.create(label="inner, undone")
                Tag.objects.create(name="taken")
        except IntegrityError:
            pass
        Charge.objects.create(label="inner kept")
        return "inner"

    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="outer")
            try:
                with transaction.atomic():
                    once(new_key(), inner)
                    raise ValueError("undo the nested once")
            except ValueError:
                pass
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["outer"]


def test_manual_savepoint_api_rolls_back_across_a_held_release() -> None:
    def work() -> str:
        sid = savepoint()
        with transaction.atomic():
            Charge.objects.create(label="in an inner block, undone with sid")
        # RELEASE of the inner block is held here; roll back to sid.
        transaction.savepoint_rollback(sid)
        Charge.objects.create(label="after")
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["after"]


@postgresql_only
def test_a_users_multi_statement_sql_with_a_held_savepoint() -> None:
    table = connection.ops.quote_name(Charge._meta.db_table)
    Tag.objects.create(name="taken")

    def work() -> Any:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} (label, amount) VALUES ('a', 1); SELECT count(*) FROM {table}"
            )
            first = cursor.rowcount
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {table} (label, amount) VALUES ('b, undone', 2); "
                    "INSERT INTO testapp_tag (name) VALUES ('taken')"
                )
        except IntegrityError:
            pass
        return first

    assert once(new_key(), work) == (True, 1)
    assert labels() == ["a"]


# -- The same attacks under other connection options ------------------------------------


@pytest.fixture
def pg_options(request: Any) -> Iterator[dict[str, Any]]:
    """Reconnect ``default`` with extra OPTIONS (server_side_binding,
    prepare_threshold), and back afterwards."""
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


SERVER_BINDING = {"server_side_binding": True}
PREPARING = {"prepare_threshold": 0}


@postgresql_only
@pytest.mark.parametrize("pg_options", [PREPARING], indirect=True, ids=str)
def test_failed_first_statement_of_a_block_under_other_options(pg_options: Any) -> None:
    Tag.objects.create(name="taken")

    def work() -> str:
        Charge.objects.create(label="before")
        for attempt in range(2):
            try:
                with transaction.atomic():
                    Tag.objects.create(name="taken")
            except IntegrityError:
                Charge.objects.create(label=f"retry {attempt}")
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["before", "retry 0", "retry 1"]


@postgresql_only
@pytest.mark.parametrize("pg_options", [PREPARING], indirect=True, ids=str)
def test_deferred_fk_at_commit_under_other_options(pg_options: Any) -> None:
    key = new_key()

    def work() -> str:
        Charge.objects.create(label="orphaned ledger")
        LedgerEntry.objects.create(charge_id=10**9, amount=1)
        return "done"

    with pytest.raises(WorkRolledBack):
        once(key, work)
    assert labels() == []
    assert once(key, lambda: "again") == (True, "again")


@postgresql_only
@pytest.mark.parametrize("pg_options", [SERVER_BINDING], indirect=True, ids=str)
def test_server_side_binding_can_claim_at_all(pg_options: Any) -> None:
    """docs/benchmarks.md offers OPTIONS server_side_binding (and the change
    set's docs say the completion and savepoints then go alone). Every claim
    fails instead: the claim reuses its named parameters, and strings sent
    as 'unknown' get two types (text versus character varying), so each
    request is a 503 idempotency_store_unavailable. (Also fails at 6cb36da:
    pre-existing; _preparing_cursor's StrDumper fixes it for its own cursor
    only.)"""
    Tag.objects.create(name="taken")

    def work() -> str:
        Charge.objects.create(label="before")
        try:
            with transaction.atomic():
                Tag.objects.create(name="taken")
        except IntegrityError:
            Charge.objects.create(label="retry")
        return "done"

    assert once(new_key(), work) == (True, "done")
    assert labels() == ["before", "retry"]


@postgresql_only
@pytest.mark.parametrize("pg_options", [PREPARING], indirect=True, ids=str)
def test_prepared_nested_claims_inside_blocks_that_fail(pg_options: Any) -> None:
    """The claim of a nested once() is prepared (server-side binding, one
    statement): the held SAVEPOINT must go ahead of it, every time."""
    Tag.objects.create(name="taken")

    def inner() -> str:
        Charge.objects.create(label="inner")
        return "inner"

    def work() -> str:
        for attempt in range(4):  # past prepare_threshold: prepared from the 1st or 2nd run
            try:
                with transaction.atomic():
                    once(new_key(), inner)
                    Tag.objects.create(name="taken")
            except IntegrityError:
                Charge.objects.create(label=f"after {attempt}")
        return "done"

    for _ in range(2):
        assert once(new_key(), work) == (True, "done")
    assert labels() == [
        "after 0",
        "after 0",
        "after 1",
        "after 1",
        "after 2",
        "after 2",
        "after 3",
        "after 3",
    ]


@postgresql_only
def test_a_commit_time_error_that_quotes_user_data_is_not_a_lost_claim(
    commit_time_failure: Any,
) -> None:
    """The merged COMMIT tells a lost claim from any other error by looking
    for CLAIM_LOST in the error's text. A commit-time error whose text quotes
    a row's data (a deferred FK's or unique constraint's DETAIL, a trigger's
    message) can carry that text from the request body."""
    from idempotency_app.store.postgresql import CLAIM_LOST

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE OR REPLACE FUNCTION fail_at_commit() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.label LIKE 'quote:%' THEN "
            "RAISE EXCEPTION 'rejected charge %', NEW.label USING ERRCODE = '23514'; "
            "END IF; RETURN NULL; END $$"
        )
    with pytest.raises((WorkRolledBack, ClaimLost)) as caught:
        once(new_key(), lambda: Charge.objects.create(label=f"quote:{CLAIM_LOST}").pk)
    assert labels() == []
    assert isinstance(caught.value, WorkRolledBack), type(caught.value).__name__


def test_replay_cache_bounds_what_it_holds_by_headers_too() -> None:
    """REPLAY_CACHE keeps nothing over 64 KB of body, but the headers stored
    with it are not counted."""
    from idempotency_app.store import Identity, StoredResponse

    identity = Identity(SCOPE, new_key(), OP, "")
    big = StoredResponse(200, (("Link", "x" * 1_000_000),), b"{}")
    with cached():
        replays.put(identity, "default", big, replays.generation())
    assert replays.get(identity, "default") is None, "a 1 MB response held in memory"
