"""An APM agent that traces PostgreSQL by wrapping the driver's connection
(Elastic APM's and Stackify's ``PGConnectionProxy``, New Relic's
``ConnectionWrapper`` for psycopg: ``psycopg.connect`` patched to return a
proxy whose ``cursor()`` hands out traced cursors) leaves
``CursorWrapper.execute``, the cursor class and ``cursor_factory``
untouched. It still sees the claim and the completion: only psycopg's own
connection sends them past the cursor."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections, transaction

from idempotency_app import service
from idempotency_app.store import postgresql
from tests.store.conftest import is_completion
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:past-the-cursor-proxy"


class Proxy:
    """A proxy as the agents make them: every attribute it does not trace
    is the wrapped object's."""

    def __init__(self, wrapped: Any, traced: list[str]) -> None:
        object.__setattr__(self, "_wrapped", wrapped)
        object.__setattr__(self, "_traced", traced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._wrapped, name, value)


class TracedCursor(Proxy):
    """The driver cursor behind an agent's proxy."""

    def __iter__(self) -> Any:
        return iter(self._wrapped)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._wrapped.__exit__(*exc)

    def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self._traced.append(str(query))
        return self._wrapped.execute(query, *args, **kwargs)

    def executemany(self, query: Any, *args: Any, **kwargs: Any) -> Any:
        self._traced.append(str(query))
        return self._wrapped.executemany(query, *args, **kwargs)


class TracedConnection(Proxy):
    """The driver connection behind an agent's proxy."""

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return TracedCursor(self._wrapped.cursor(*args, **kwargs), self._traced)


@pytest.fixture
def traced() -> Iterator[list[str]]:
    traced: list[str] = []
    wrapper_class = type(connections["default"])
    connect = wrapper_class.get_new_connection

    def get_new_connection(self: Any, params: Any) -> Any:
        return TracedConnection(connect(self, params), traced)

    connection.close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wrapper_class, "get_new_connection", get_new_connection)
        try:
            yield traced
        finally:
            connection.close()


def test_an_agent_that_proxies_the_driver_connection_sees_the_claim_and_the_completion(
    traced: list[str],
) -> None:
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            Charge.objects.create(label="a")
            run.result = "done"
    assert run.result == "done"
    claims = [sql for sql in traced if postgresql.CLAIM_FUNCTION in sql]
    completions = [sql for sql in traced if is_completion(sql)]
    assert (len(claims), len(completions)) == (1, 1), traced


def test_an_agent_that_proxies_the_driver_connection_sees_a_blocks_savepoint(
    traced: list[str],
) -> None:
    """A block that opens the work's transaction: its SAVEPOINT, which the
    guard would otherwise send with the BEGIN through libpq's own call,
    reaches the agent's cursor."""
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            with transaction.atomic():
                Charge.objects.create(label="a")
            run.result = "done"
    assert run.result == "done"
    assert any(sql.startswith("SAVEPOINT") for sql in traced), traced
