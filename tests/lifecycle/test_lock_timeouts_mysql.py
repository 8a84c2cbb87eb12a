"""MariaDB: lock-wait timeouts caught by the work."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction

from idempotency_app import service
from idempotency_app.exceptions import WorkRolledBack
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.mysql]


def once(key: str, work: Any) -> Any:
    with service.once("tests:locks", key, "tests.locks") as run:
        if run.should_execute:
            run.result = work()
    return run.result


@pytest.fixture
def locked() -> Any:
    import MySQLdb

    victim = Charge.objects.create(label="victim")
    s = connection.settings_dict
    conn = MySQLdb.connect(
        host=s["HOST"], port=int(s["PORT"]), user=s["USER"], passwd=s["PASSWORD"], db=s["NAME"]
    )
    conn.autocommit(False)
    cur = conn.cursor()
    table = connection.ops.quote_name(Charge._meta.db_table)
    cur.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE", [victim.pk])
    yield victim
    conn.rollback()
    conn.close()


def test_a_lock_wait_timeout_caught_in_a_block_then_more_work(key: str, locked: Charge) -> None:
    hooks: list[str] = []

    def work() -> str:
        with connection.cursor() as c:
            c.execute("SET SESSION innodb_lock_wait_timeout = 1")
        Charge.objects.create(label="before")
        transaction.on_commit(lambda: hooks.append("ran"))
        try:
            with transaction.atomic():
                Charge.objects.create(label="undone")
                Charge.objects.select_for_update().get(pk=locked.pk)
        except DatabaseError:
            pass
        with transaction.atomic():
            Charge.objects.create(label="after")
        return "done"

    assert once(key, work) == "done"
    assert labels() == ["after", "before", "victim"]
    assert hooks == ["ran"]
    assert once(key, lambda: "ran twice") == "done"


def test_a_lock_wait_timeout_caught_without_a_block_is_no_success(key: str, locked: Charge) -> None:
    hooks: list[str] = []

    def work() -> str:
        with connection.cursor() as c:
            c.execute("SET SESSION innodb_lock_wait_timeout = 1")
        Charge.objects.create(label="before")
        transaction.on_commit(lambda: hooks.append("ran"))
        with contextlib.suppress(DatabaseError):
            Charge.objects.select_for_update().get(pk=locked.pk)
        return "done"

    with pytest.raises((DatabaseError, WorkRolledBack)):
        once(key, work)
    assert labels() == ["victim"]
    assert hooks == []
    assert not IdempotencyRecord.objects.filter(key=key).exists()
