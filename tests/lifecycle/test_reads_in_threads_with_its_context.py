"""Reads a thread started with the work's context sends through its own
connection must run (docs/guarantees.md: "their reads run")."""

from __future__ import annotations

import contextvars
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections, transaction

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]

SCOPE = "tests:reads"


def in_thread(task: Callable[[], Any]) -> list[Any]:
    out: list[Any] = []

    def call() -> None:
        try:
            out.append(task())
        except Exception as exc:
            out.append(exc)
        finally:
            connections.close_all()

    context = contextvars.copy_context()
    t = threading.Thread(target=context.run, args=(call,))
    t.start()
    t.join()
    return out


def atomic_select_for_update() -> Any:
    with transaction.atomic():
        return len(list(Charge.objects.select_for_update().filter(label="committed")))


def nested_atomic_read() -> Any:
    with transaction.atomic():
        with transaction.atomic():
            n = Charge.objects.count()
        return n


def raw_set_and_show() -> Any:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SET statement_timeout = 5000"
            if connections["default"].vendor == "postgresql"
            else "SET @x = 1"
        )
        cursor.execute("SELECT 1")
        return cursor.fetchone()[0]


def iterator_read() -> Any:
    return len(list(Charge.objects.iterator(chunk_size=1)))


def atomic_iterator_read() -> Any:
    with transaction.atomic():
        return len(list(Charge.objects.iterator(chunk_size=1)))


def get_or_create_existing() -> Any:
    return Charge.objects.get_or_create(label="committed", defaults={"amount": 1})[1]


def exists_read() -> Any:
    return Charge.objects.filter(label="committed").exists()


READS = [
    atomic_select_for_update,
    nested_atomic_read,
    raw_set_and_show,
    iterator_read,
    atomic_iterator_read,
    get_or_create_existing,
    exists_read,
]
EXPECTED = {
    "atomic_select_for_update": 1,
    "nested_atomic_read": 1,
    "raw_set_and_show": 1,
    "iterator_read": 1,
    "atomic_iterator_read": 1,
    "get_or_create_existing": False,
    "exists_read": True,
}


@pytest.mark.parametrize("read", READS, ids=lambda f: f.__name__)
def test_a_read_in_a_thread_with_the_works_context_runs(read: Any) -> None:
    Charge.objects.create(label="committed")
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            seen = in_thread(read)
            run.result = "done"
    assert seen == [EXPECTED[read.__name__]]
    assert run.result == "done"
