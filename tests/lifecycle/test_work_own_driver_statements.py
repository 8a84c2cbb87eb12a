"""The work's own statements through the driver's cursor (``executemany``,
a cursor made from the driver connection, nested claims) are never taken
for another connection's; a write from ``asyncio.to_thread``, which copies
the work's context to another thread, is."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from django.db import connection, connections, transaction

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]

SCOPE = "tests:work-own-driver-statements"


def _run(body: Any) -> Any:
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            body()
            run.result = "done"
    return run.result


def test_raw_executemany_on_the_works_connection() -> None:
    def body() -> None:
        with connection.cursor() as cursor:
            cursor.cursor.executemany(
                "INSERT INTO testapp_charge (label, amount) VALUES (%s, %s)", [("a", 1), ("b", 2)]
            )

    assert _run(body) == "done"
    assert Charge.objects.count() == 2


def test_a_driver_cursor_made_from_the_raw_connection() -> None:
    def body() -> None:
        connection.ensure_connection()
        with connection.connection.cursor() as cursor:
            cursor.execute("INSERT INTO testapp_charge (label, amount) VALUES ('a', 1)")

    assert _run(body) == "done"
    assert Charge.objects.count() == 1


def test_inside_atomic_requests_style_outer_block_nested_claims() -> None:
    with transaction.atomic():
        Charge.objects.create(label="outer")
        with service.once(SCOPE, str(uuid.uuid4()), "op") as outer:
            if outer.should_execute:
                with service.once(SCOPE, str(uuid.uuid4()), "op") as inner:
                    if inner.should_execute:
                        with connection.cursor() as cursor:
                            cursor.cursor.execute(
                                "INSERT INTO testapp_charge (label, amount) VALUES ('i', 1)"
                            )
                        inner.result = "in"
                outer.result = "out"
    assert (outer.result, inner.result) == ("out", "in")
    assert Charge.objects.count() == 2


def test_a_write_from_asyncio_to_thread_is_refused() -> None:
    """asyncio.to_thread copies the context like copy_context().run."""
    from idempotency_app.exceptions import CannotBeAtomic

    out: list[Any] = []

    def write() -> None:
        try:
            Charge.objects.create(label="thread")
        except Exception as exc:
            out.append(exc)
        finally:
            connections.close_all()

    with pytest.raises(CannotBeAtomic), service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            asyncio.run(asyncio.to_thread(write))
            run.result = "done"
    assert Charge.objects.count() == 0
