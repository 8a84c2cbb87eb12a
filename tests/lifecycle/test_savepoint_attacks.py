"""Work that tries what a savepoint held back could get wrong: lock
timeouts, set_rollback, savepoint=False, raw savepoint SQL, executemany, a
second alias, deferred constraints at the COMMIT, on_commit hooks. Each
test asserts a guarantee; it fails if broken."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from django.db import DatabaseError, IntegrityError, connection, transaction

from idempotency_app import service
from idempotency_app.exceptions import CannotBeAtomic, WorkRolledBack
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels
from tests.savepoints import savepoint
from tests.testapp.models import AuditEntry, Charge, LedgerEntry, Tag

pytestmark = pytest.mark.django_db(transaction=True)
FAILED = (DatabaseError, WorkRolledBack, CannotBeAtomic)


def once(key: str, work: Any) -> Any:
    with service.once("tests:attacks", key, "tests.attacks") as run:
        if run.should_execute:
            run.result = work()
    return run.result


def assert_nothing_kept(key: str) -> None:
    assert labels() == []
    assert not IdempotencyRecord.objects.filter(key=key).exists()


def fails_keeping_nothing(key: str, work: Any) -> None:
    with pytest.raises(FAILED):
        once(key, work)
    assert_nothing_kept(key)


def assert_replays(key: str, result: Any) -> None:
    def boom() -> Any:
        raise AssertionError("ran twice")

    assert once(key, boom) == result


# -- on_commit and the COMMIT sent with the completion ------------------------


@pytest.mark.postgresql
def test_a_deferred_fk_failing_at_commit_is_no_success_and_runs_no_hook(key: str) -> None:
    hooks: list[str] = []

    def work() -> str:
        Charge.objects.create(label="w")
        LedgerEntry.objects.create(charge_id=987654321, amount=1)  # deferred FK: fails at COMMIT
        transaction.on_commit(lambda: hooks.append("ran"))
        return "done"

    with pytest.raises(FAILED):
        once(key, work)
    assert hooks == []
    assert_nothing_kept(key)
    assert LedgerEntry.objects.count() == 0


def test_on_commit_runs_once_on_success_and_never_on_rollback(key: str) -> None:
    hooks: list[str] = []

    def work() -> str:
        Charge.objects.create(label="w")
        with transaction.atomic():
            transaction.on_commit(lambda: hooks.append("inner"))
        try:
            with transaction.atomic():
                transaction.on_commit(lambda: hooks.append("rolled back"))
                raise ValueError
        except ValueError:
            pass
        transaction.on_commit(lambda: hooks.append("outer"))
        return "done"

    assert once(key, work) == "done"
    assert hooks == ["inner", "outer"]
    assert_replays(key, "done")
    assert hooks == ["inner", "outer"]


@pytest.mark.postgresql
@pytest.mark.parametrize("caller", ["alone", "in the caller's transaction"])
def test_no_hook_when_a_held_release_is_refused(key: str, caller: str) -> None:
    hooks: list[str] = []

    def work() -> str:
        Charge.objects.create(label="w")
        transaction.on_commit(lambda: hooks.append("ran"))
        sid = savepoint()
        with transaction.atomic():
            transaction.savepoint_rollback(sid)
        return "done"

    with pytest.raises(FAILED):
        if caller == "alone":
            once(key, work)
        else:
            with transaction.atomic():
                once(key, work)
    assert hooks == []
    assert_nothing_kept(key)


# -- lock timeouts -------------------------------------------------------------


class Locker:
    """Another connection holding a row lock on a Charge."""

    def __init__(self, pk: int) -> None:
        import psycopg

        s = connection.settings_dict
        self.conn = psycopg.connect(
            host=s["HOST"],
            port=s["PORT"],
            user=s["USER"],
            password=s["PASSWORD"] or None,
            dbname=s["NAME"],
        )
        table = connection.ops.quote_name(Charge._meta.db_table)
        self.conn.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE", [pk])

    def close(self) -> None:
        self.conn.rollback()
        self.conn.close()


@pytest.fixture
def locked() -> Any:
    victim = Charge.objects.create(label="victim")
    locker = Locker(victim.pk)
    yield victim
    locker.close()


@pytest.mark.postgresql
def test_a_lock_timeout_caught_in_a_block_then_more_work(key: str, locked: Charge) -> None:
    def work() -> str:
        Charge.objects.create(label="before")
        with transaction.atomic():
            pass  # a held RELEASE rides in front of the failing statement
        try:
            with transaction.atomic():
                with connection.cursor() as c:
                    c.execute("SET LOCAL lock_timeout = '50ms'")
                Charge.objects.create(label="undone")
                Charge.objects.select_for_update().get(pk=locked.pk)
        except DatabaseError:
            pass
        with transaction.atomic():
            Charge.objects.create(label="after")
        return "done"

    assert once(key, work) == "done"
    assert labels() == ["after", "before", "victim"]
    assert_replays(key, "done")


@pytest.mark.postgresql
def test_a_lock_timeout_caught_without_a_block_is_no_success(key: str, locked: Charge) -> None:
    def work() -> str:
        Charge.objects.create(label="before")
        with connection.cursor() as c:
            c.execute("SET LOCAL lock_timeout = '50ms'")
        with contextlib.suppress(DatabaseError):
            Charge.objects.select_for_update().get(pk=locked.pk)
        return "done"

    with pytest.raises(FAILED):
        once(key, work)
    assert labels() == ["victim"]
    assert not IdempotencyRecord.objects.filter(key=key).exists()


@pytest.mark.postgresql
def test_select_for_update_nowait_in_nested_blocks(key: str, locked: Charge) -> None:
    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="outer")
            with transaction.atomic():
                pass
            try:
                with transaction.atomic():
                    with transaction.atomic():
                        Charge.objects.create(label="undone")
                    list(Charge.objects.select_for_update(nowait=True).filter(pk=locked.pk))
            except DatabaseError:
                pass
            with transaction.atomic():
                list(Charge.objects.select_for_update().filter(label="outer"))
        return "done"

    assert once(key, work) == "done"
    assert labels() == ["outer", "victim"]


# -- set_rollback and savepoint=False ------------------------------------------


def test_set_rollback_inside_a_block_undoes_only_the_block(key: str) -> None:
    def work() -> str:
        Charge.objects.create(label="kept")
        with transaction.atomic():
            Charge.objects.create(label="undone")
            transaction.set_rollback(True)
        return "done"

    assert once(key, work) == "done"
    assert labels() == ["kept"]


def test_set_rollback_at_the_works_level_is_no_success(key: str) -> None:
    def work() -> str:
        Charge.objects.create(label="w")
        with transaction.atomic():
            pass
        transaction.set_rollback(True)
        return "done"

    fails_keeping_nothing(key, work)


def test_a_failed_savepoint_false_block_inside_a_savepoint_block_is_undone_by_it(key: str) -> None:
    Tag.objects.create(name="taken")

    def work() -> str:
        Charge.objects.create(label="w")
        try:
            with transaction.atomic(), transaction.atomic(savepoint=False):
                Tag.objects.create(name="taken")
        except IntegrityError:
            pass
        Charge.objects.create(label="after")
        return "done"

    # The outer block rolls back to its savepoint; the work carries on: a success.
    assert once(key, work) == "done"
    assert labels() == ["after", "w"]


def test_a_failed_savepoint_false_block_at_the_top_caught_is_no_success(key: str) -> None:
    Tag.objects.create(name="taken")

    def work() -> str:
        Charge.objects.create(label="w")
        try:
            with transaction.atomic(savepoint=False):
                Tag.objects.create(name="taken")
        except IntegrityError:
            pass
        return "done"

    fails_keeping_nothing(key, work)


# -- raw savepoint SQL typed by the user -----------------------------------------


@pytest.mark.postgresql
@pytest.mark.parametrize(
    "release",
    [
        'RELEASE SAVEPOINT "{sid}"',
        '/* c */ RELEASE SAVEPOINT "{sid}"',
        "release savepoint {sid}",
        'RELEASE SAVEPOINT "{sid}"; SELECT 1',
    ],
)
def test_a_raw_release_of_a_destroyed_savepoint_fails_the_work(key: str, release: str) -> None:
    def work() -> str:
        Charge.objects.create(label="w")
        outer = savepoint()
        inner = savepoint()
        transaction.savepoint_rollback(outer)  # destroys inner
        with connection.cursor() as c:
            c.execute(release.format(sid=inner))
        return "done"

    fails_keeping_nothing(key, work)


@pytest.mark.postgresql
@pytest.mark.parametrize(
    "rollback",
    [
        'ROLLBACK TO SAVEPOINT "{sid}"',
        "rollback to savepoint {sid}",
        '/* c */ ROLLBACK TO SAVEPOINT "{sid}"',
    ],
)
def test_a_raw_rollback_to_does_not_drop_a_refused_release(key: str, rollback: str) -> None:
    def work() -> str:
        Charge.objects.create(label="w")
        outer = savepoint()
        inner = savepoint()
        transaction.savepoint_commit(inner)
        transaction.savepoint_commit(inner)  # refused without a key
        with connection.cursor() as c:
            c.execute(rollback.format(sid=outer))
        return "done"

    fails_keeping_nothing(key, work)


def _executemany() -> None:
    table = connection.ops.quote_name(Charge._meta.db_table)
    with connection.cursor() as c:
        c.executemany(f"INSERT INTO {table} (label, amount) VALUES (%s, %s)", [("m", 1)])


def _callproc() -> None:
    with connection.cursor() as c:
        c.callproc("pg_sleep", [0])


def _the_drivers_own_cursor() -> None:
    table = connection.ops.quote_name(Charge._meta.db_table)
    raw = connection.connection.cursor()
    raw.execute(f"INSERT INTO {table} (label, amount) VALUES ('raw', 1)")
    raw.close()


@pytest.mark.postgresql
@pytest.mark.parametrize("then", [_executemany, _callproc, _the_drivers_own_cursor])
def test_sql_that_cannot_carry_a_refused_release_still_fails_the_work(
    key: str, then: Callable[[], None]
) -> None:
    def work() -> str:
        sid = savepoint()
        with transaction.atomic():  # its RELEASE is refused
            transaction.savepoint_rollback(sid)
        then()
        return "done"

    fails_keeping_nothing(key, work)


# -- a second alias ----------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_write_to_the_other_alias_caught_is_still_refused(key: str) -> None:
    def work() -> str:
        Charge.objects.create(label="w")
        try:
            with transaction.atomic(using="other"):
                AuditEntry.objects.using("other").create(note="x")
        except CannotBeAtomic:
            pass
        return "done"

    with pytest.raises(CannotBeAtomic):
        once(key, work)
    assert_nothing_kept(key)
    assert AuditEntry.objects.using("other").count() == 0


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_refused_release_around_a_read_of_the_other_alias(key: str) -> None:
    def work() -> str:
        Charge.objects.create(label="w")
        sid = savepoint()
        with transaction.atomic():
            transaction.savepoint_rollback(sid)
        list(AuditEntry.objects.using("other").all())
        with transaction.atomic(using="other"):
            list(AuditEntry.objects.using("other").all())
        return "done"

    fails_keeping_nothing(key, work)


# -- clean_savepoints() ------------------------------------------------------------


def test_clean_savepoints_in_the_middle_of_the_work(key: str) -> None:
    def work() -> str:
        Charge.objects.create(label="a")
        with transaction.atomic():
            Charge.objects.create(label="b")
        transaction.clean_savepoints()
        try:
            with transaction.atomic():
                Charge.objects.create(label="undone")
                raise ValueError
        except ValueError:
            pass
        with transaction.atomic():
            Charge.objects.create(label="c")
        return "done"

    assert once(key, work) == "done"
    assert labels() == ["a", "b", "c"]
    assert_replays(key, "done")
