"""Django's psycopg pool (``OPTIONS["pool"]``, Django 5.1+) hands the same
driver connection out again on each checkout, its ``cursor_factory`` as
it was left, and Django sends ``connection_created`` each time: the
statement guard wraps the driver's cursor class once, whatever the number
of checkouts (one layer per checkout stopped the claim going past the
cursor from the second, and ended in a ``RecursionError``)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connections

from idempotency_app import service
from idempotency_app.lifecycle import work
from idempotency_app.store import postgresql
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


@pytest.fixture(autouse=True)
def _fresh_connection() -> Any:
    yield
    connections["default"].close()


def _checkouts(n: int) -> Any:
    connection = connections["default"]
    connection.ensure_connection()
    raw = connection.connection
    for _ in range(n):  # what each pooled checkout does to the same raw connection
        work.guard_raw_cursors(sender=type(connection), connection=connection)
    return raw


def test_a_reused_pooled_connection_is_guarded_once() -> None:
    raw = _checkouts(3)
    factory = raw.cursor_factory
    guarded = factory.__dict__[postgresql.GUARDED_CLASS]
    assert postgresql.GUARDED_CLASS not in vars(guarded), factory.__mro__


def test_a_reused_pooled_connection_still_sends_past_the_cursor() -> None:
    raw = _checkouts(2)
    assert postgresql.unseen_by_agents(connections["default"]) and raw is not None


def test_many_checkouts_of_a_pooled_connection_still_run_the_work() -> None:
    _checkouts(1500)
    with service.once("tests:guard-pooled", str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            Charge.objects.create(label="a")
            run.result = "done"
    assert run.result == "done"
