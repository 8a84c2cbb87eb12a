"""OpenTelemetry's ``PsycopgInstrumentor.instrument_connection(conn)``
instruments one psycopg connection by setting its ``cursor_factory`` to a
subclass whose ``execute`` traces: state of the driver connection itself,
which may change at any time. The agent checks' answer for a unit
(``judged_for_the_unit``) is kept per cursor class too: kept per driver
connection alone, a traced factory set after the unit's claim was judged
was never looked at, and the completion (with its COMMIT) and a block's
first SAVEPOINT went through libpq past it."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction

from idempotency_app import service
from tests.store.conftest import is_completion
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:cursor-factory-mid-unit"


def _instrument_connection(raw: Any, traced: list[str]) -> None:
    """As opentelemetry-instrumentation-psycopg's instrument_connection."""
    base = raw.cursor_factory

    class TracedCursorFactory(base):  # type: ignore[misc, valid-type]
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            traced.append(str(query))
            return super().execute(query, *args, **kwargs)

    raw._otel_original_cursor_factory = base
    raw.cursor_factory = TracedCursorFactory


def _instrumented_during_the_work(body: Callable[[], None]) -> list[str]:
    """What the traced cursor class saw of a unit whose work instruments its
    connection, then runs ``body``."""
    traced: list[str] = []
    raw = None
    try:
        with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
            if run.should_execute:
                raw = connection.connection
                _instrument_connection(raw, traced)
                body()
                run.result = "done"
        assert run.result == "done"
    finally:
        if raw is not None:
            raw.cursor_factory = raw._otel_original_cursor_factory
    return traced


def test_a_connection_instrumented_during_the_work_sees_the_completion() -> None:
    def one_write() -> None:
        Charge.objects.create(label="a")

    traced = _instrumented_during_the_work(one_write)
    assert any("INSERT" in s and "charge" in s.lower() for s in traced), traced
    # The library's completion went through the instrumented connection.
    assert any(is_completion(s) for s in traced), traced


def test_a_connection_instrumented_during_the_work_sees_a_block_s_savepoint() -> None:
    def in_a_block() -> None:
        with transaction.atomic():
            Charge.objects.create(label="a")

    traced = _instrumented_during_the_work(in_a_block)
    assert any(s.startswith("SAVEPOINT") for s in traced), traced
