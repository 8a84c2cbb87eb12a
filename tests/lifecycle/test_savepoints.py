"""``transaction.atomic()`` blocks inside the work: savepoints that keep
their meaning whatever round trips they are sent in.

On PostgreSQL (psycopg 3, client-side binding) the work's RELEASE SAVEPOINT
travels in front of the next statement instead of alone. Each test here
does what would show a savepoint that was not there when it mattered, or
released too soon: an inner block that fails and is caught, the work
carrying on after it, on every backend.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import (
    DatabaseError,
    IntegrityError,
    OperationalError,
    connection,
    transaction,
)

from idempotency_app import service
from idempotency_app.exceptions import WorkRolledBack
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels, end_session, session_id
from tests.savepoints import savepoint
from tests.store.test_round_trips import round_trips
from tests.testapp.models import Charge, Tag

pytestmark = pytest.mark.django_db(transaction=True)

SCOPE = "tests:savepoints"


def once(key: str, work: Any) -> Any:
    with service.once(SCOPE, key, "tests.savepoints") as run:
        if run.should_execute:
            run.result = work()
    return run.result


def test_a_failed_inner_block_caught_by_the_work_undoes_only_itself() -> None:
    Tag.objects.create(name="taken")

    def work() -> str:
        Charge.objects.create(label="before")
        try:
            with transaction.atomic():
                Charge.objects.create(label="inside, undone")
                Tag.objects.create(name="taken")
        except IntegrityError:
            pass
        Charge.objects.create(label="after")
        return "done"

    assert once("k1", work) == "done"
    assert labels() == ["after", "before"]


@pytest.mark.parametrize("first", ["a failed INSERT", "an exception"])
def test_a_block_that_opens_the_transaction_and_fails_undoes_only_itself(first: str) -> None:
    """On PostgreSQL this block's SAVEPOINT goes with the BEGIN: it must
    still mark where the block began, so that rolling back to it keeps the
    transaction and the work after it."""
    Tag.objects.create(name="taken")

    def work() -> str:
        try:
            with transaction.atomic():
                Charge.objects.create(label="inside, undone")
                if first == "an exception":
                    raise ValueError(first)
                Tag.objects.create(name="taken")
        except (IntegrityError, ValueError):
            pass
        Charge.objects.create(label="after")
        return "done"

    assert once(f"k-open-{first}", work) == "done"
    assert labels() == ["after"]


@pytest.mark.postgresql
def test_a_transaction_with_an_isolation_level_opens_as_psycopg_would(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection whose transactions open with options (OPTIONS
    isolation_level) keeps psycopg's own BEGIN: the block's SAVEPOINT then
    has a round trip of its own, and the work runs at that level."""
    from psycopg import IsolationLevel

    def work() -> str:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            return str(cursor.fetchone()[0])

    options = connection.settings_dict["OPTIONS"]
    monkeypatch.setitem(options, "isolation_level", IsolationLevel.SERIALIZABLE)
    connection.close()  # a session of its own, opened with the option
    try:
        trips, level = round_trips(lambda: once(key, work))
    finally:
        connection.close()
    assert level == "serializable"
    assert trips[1] == "BEGIN ISOLATION LEVEL SERIALIZABLE", trips
    assert trips[2].startswith("SAVEPOINT"), trips


@pytest.mark.postgresql
def test_a_session_lost_before_the_first_block_is_an_outage(key: str) -> None:
    """The BEGIN and the SAVEPOINT go through libpq's own call: a session
    ended by the server must still be the driver's OperationalError, as
    psycopg would raise it (nothing kept, the key free to run again), not a
    bare database error."""
    from idempotency_app.exceptions import StoreUnavailable

    session = session_id()

    def work() -> str:
        end_session(session)
        with transaction.atomic():
            Charge.objects.create(label="never")
        return "done"

    with pytest.raises((OperationalError, StoreUnavailable)):
        once(key, work)
    connection.close()
    assert labels() == []
    assert not IdempotencyRecord.objects.filter(key=key, response_body__isnull=False).exists()


def test_the_failing_statement_is_the_first_in_the_block() -> None:
    """The SAVEPOINT goes out with the statement that fails: it must still
    be in place before that statement, or the rollback to it fails."""
    Tag.objects.create(name="taken")

    def work() -> str:
        for attempt in range(3):
            try:
                with transaction.atomic():
                    Tag.objects.create(name="taken")
            except IntegrityError:
                Charge.objects.create(label=f"retry {attempt}")
        return "done"

    assert once("k2", work) == "done"
    assert labels() == ["retry 0", "retry 1", "retry 2"]


def test_nested_blocks_roll_back_to_the_right_savepoint() -> None:
    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="outer")
            try:
                with transaction.atomic():
                    with transaction.atomic():  # nothing runs in this one
                        pass
                    Charge.objects.create(label="inner, undone")
                    raise ValueError("undo the inner block")
            except ValueError:
                pass
            with transaction.atomic():
                pass
        Charge.objects.create(label="last")
        return "done"

    assert once("k3", work) == "done"
    assert labels() == ["last", "outer"]


def test_a_statement_refused_before_it_was_sent_keeps_the_savepoint_to_send() -> None:
    """A parameter the driver cannot adapt fails before anything is sent;
    the SAVEPOINT held for it must still go out with the next statement."""

    def work() -> str:
        Charge.objects.create(label="kept")
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT %s", [object()])
        except Exception:
            pass
        with transaction.atomic():
            Charge.objects.create(label="inside")
        return "done"

    assert once("k4", work) == "done"
    assert labels() == ["inside", "kept"]


def test_executemany_and_the_drivers_cursor_inside_a_block() -> None:
    table = connection.ops.quote_name(Charge._meta.db_table)

    def work() -> str:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.executemany(
                        f"INSERT INTO {table} (label, amount) VALUES (%s, %s)",
                        [("many 1", 1), ("many 2", 2)],
                    )
                raise ValueError("undo")
        except ValueError:
            pass
        with transaction.atomic():
            connection.ensure_connection()
            raw = connection.connection.cursor()
            raw.execute(f"INSERT INTO {table} (label, amount) VALUES ('raw', 1)")
            raw.close()
        return "done"

    assert once("k5", work) == "done"
    assert labels() == ["raw"]


def test_the_manual_savepoint_api() -> None:
    def work() -> str:
        Charge.objects.create(label="kept")
        sid = savepoint()
        Charge.objects.create(label="undone")
        transaction.savepoint_rollback(sid)
        sid = savepoint()
        Charge.objects.create(label="released")
        transaction.savepoint_commit(sid)
        return "done"

    assert once("k6", work) == "done"
    assert labels() == ["kept", "released"]


def _refused_release_in_a_block_that_ends_the_work() -> str:
    Charge.objects.create(label="before the savepoint")
    sid = savepoint()
    with transaction.atomic():  # its RELEASE is refused: the rollback below destroyed it
        Charge.objects.create(label="undone")
        transaction.savepoint_rollback(sid)
    return "done"


def _savepoint_released_twice() -> str:
    Charge.objects.create(label="w")
    sid = savepoint()
    transaction.savepoint_commit(sid)
    transaction.savepoint_commit(sid)  # the server refuses: no such savepoint
    return "done"


def _released_twice_then_rolled_back_past() -> str:
    Charge.objects.create(label="w")
    outer = savepoint()
    inner = savepoint()
    transaction.savepoint_commit(inner)
    transaction.savepoint_commit(inner)  # refused
    transaction.savepoint_rollback(outer)  # would destroy inner: the refusal must still count
    return "done"


def _refused_release_then_rolled_back_past() -> str:
    Charge.objects.create(label="w")
    outer = savepoint()
    inner = savepoint()
    with transaction.atomic():  # its RELEASE is refused: the rollback below destroyed it
        Charge.objects.create(label="undone")
        transaction.savepoint_rollback(inner)
    with connection.cursor() as cursor:  # the rollback typed as Django sends it
        cursor.execute(connection.ops.savepoint_rollback_sql(outer))
    return "done"


def _refused_release_in_a_block_left_by_an_expected_exception() -> str:
    Charge.objects.create(label="w")
    try:
        with transaction.atomic():  # left by the ValueError: rolled back to its savepoint
            sid = savepoint()
            with transaction.atomic():  # its RELEASE is refused
                transaction.savepoint_rollback(sid)
            raise ValueError("expected by the work")
    except ValueError:
        pass
    return "done"


def _refused_release_then_a_statement_the_driver_refuses() -> str:
    Charge.objects.create(label="w")
    sid = savepoint()
    with transaction.atomic():  # its RELEASE is refused
        transaction.savepoint_rollback(sid)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT %(a)s", [1])  # never sent: a TypeError in the driver
    except TypeError:
        transaction.set_rollback(False)  # true: nothing reached the server
    Charge.objects.create(label="after")
    return "done"


REFUSED_RELEASES = [
    _refused_release_in_a_block_that_ends_the_work,
    _savepoint_released_twice,
    _released_twice_then_rolled_back_past,
    _refused_release_then_rolled_back_past,
    _refused_release_in_a_block_left_by_an_expected_exception,
    _refused_release_then_a_statement_the_driver_refuses,
]


@pytest.mark.parametrize("work", REFUSED_RELEASES)
def test_without_a_key_a_refused_release_fails_the_work(work: Any) -> None:
    with pytest.raises(DatabaseError), transaction.atomic():
        work()
    assert labels() == []


@pytest.mark.parametrize("work", REFUSED_RELEASES)
@pytest.mark.parametrize("caller", ["alone", "in the caller's transaction"])
def test_a_release_the_server_refuses_fails_the_work(key: str, work: Any, caller: str) -> None:
    """Without a key Django's RELEASE fails and so does the work (above);
    held back, it must still reach the server before the outcome is stored:
    not be dropped at the COMMIT (or at the release of the savepoint around
    a claim made inside the caller's transaction), nor by a ROLLBACK TO of
    an earlier savepoint, nor with a statement that never reached the
    server."""
    with pytest.raises((DatabaseError, WorkRolledBack)):  # the driver's error, or rolled back
        if caller == "alone":
            once(key, work)
        else:
            with transaction.atomic():
                once(key, work)
    assert labels() == []
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def test_a_block_that_ends_work_in_the_callers_transaction(key: str) -> None:
    """The held release goes in front of the completion of a claim made
    inside a transaction, whose rows count is then still the completion's."""

    def work() -> str:
        Charge.objects.create(label="before")
        with transaction.atomic():
            Charge.objects.create(label="in the block")
        return "done"

    with transaction.atomic():
        assert once(key, work) == "done"
    assert once(key, work) == "done"  # a replay: the completion matched its row
    assert labels() == ["before", "in the block"]


@pytest.mark.postgresql
def test_a_block_costs_no_release_and_the_first_no_savepoint(key: str) -> None:
    def plain() -> None:
        Charge.objects.create(label="a")
        Charge.objects.create(label="b")

    def in_blocks() -> None:
        with transaction.atomic():
            Charge.objects.create(label="a")
            with transaction.atomic():
                pass
            Charge.objects.create(label="b")

    without, _ = round_trips(lambda: once(f"{key}-1", plain))
    with_blocks, _ = round_trips(lambda: once(f"{key}-2", in_blocks))
    # The first SAVEPOINT goes with the BEGIN, the second alone; each RELEASE
    # rides with the next statement or the COMMIT.
    assert len(with_blocks) == len(without) + 1, (without, with_blocks)
    assert with_blocks[1].startswith("BEGIN; SAVEPOINT"), with_blocks


def test_the_guard_reads_each_orm_statement_without_its_lexer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ORM statements take the guard's fast path, also when savepoints are
    sent in front of them (the driver's cursor must not judge the combined
    text again): the lexer costs tens of microseconds a statement."""
    from idempotency_app.lifecycle import statements

    lexed: list[str] = []
    split = statements.split

    def counting(sql: str, *args: Any, **kwargs: Any) -> Any:
        lexed.append(sql)
        return split(sql, *args, **kwargs)

    monkeypatch.setattr(statements, "split", counting)

    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="a")
            with transaction.atomic():
                Charge.objects.create(label="b")
        return "done"

    assert once("k9", work) == "done"
    assert lexed == []


@pytest.mark.postgresql
def test_a_claim_inside_the_work_on_a_preparing_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim made inside the work (an event handled inside another) opens
    a savepoint, then claims through a cursor that binds on the server where
    the claim is prepared: that cursor takes one statement, so the held
    savepoint must go ahead of it, not in front."""
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "prepare_threshold", 1)
    connection.close()
    try:

        def outer() -> str:
            Charge.objects.create(label="outer")
            return once("inner", lambda: Charge.objects.create(label="inner") and "inner done")

        assert once("outer", outer) == "inner done"
        assert once("outer", outer) == "inner done"  # replayed
    finally:
        connection.close()
    assert labels() == ["inner", "outer"]
