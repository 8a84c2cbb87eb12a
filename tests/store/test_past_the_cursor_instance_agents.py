"""An agent that instruments each driver connection as it is made, by
setting a tracing ``cursor`` on the psycopg connection *instance*
(``raw.cursor = traced``, from ``connection_created``, as ddtrace does to
Django's connection one level up). Django's ``create_cursor`` calls
``self.connection.cursor()``, which finds the instance's attribute: the
agent sees every statement Django sends. The agent checks looked at
``type(raw).cursor`` only (``store.postgresql.unseen_by_agents``), so
the claim, the completion and a block's first SAVEPOINT went past the
cursor, unseen.

The guarantee: a ``cursor`` (or any function on the way) set on the
driver connection instance counts as an agent's (as ``keeps_a_cursor``
does for Django's connection, asked once it is connected): the library's statements go
through the cursor and the agent sees them."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, connections
from django.db.backends.signals import connection_created

from tests.store.test_past_the_cursor_agent_shapes import one_request, saw_each_statement_once
from tests.store.test_past_the_cursor_connection_proxy_agent import TracedCursor

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def on_driver_connection(connection: Any, traced: list[str]) -> None:
    """psycopg's Connection.cursor, set on the driver connection instance."""
    raw = connection.connection
    driver_cursor = type(raw).cursor

    def cursor(*args: Any, **kwargs: Any) -> Any:
        return TracedCursor(driver_cursor(raw, *args, **kwargs), traced)

    raw.cursor = cursor


def on_django_create_cursor(connection: Any, traced: list[str]) -> None:
    """Django's create_cursor, set on the Django connection instance."""
    create = type(connection).create_cursor

    def create_cursor(name: Any = None) -> Any:
        return TracedCursor(create(connection, name), traced)

    connection.create_cursor = create_cursor


def on_django_make_cursor(connection: Any, traced: list[str]) -> None:
    """Django's make_cursor, set on the Django connection instance."""
    make = type(connection).make_cursor

    def make_cursor(cursor: Any) -> Any:
        wrapper = make(connection, cursor)
        wrapper.cursor = TracedCursor(wrapper.cursor, traced)
        return wrapper

    connection.make_cursor = make_cursor


INSTRUMENTS = [on_driver_connection, on_django_create_cursor, on_django_make_cursor]


@pytest.mark.parametrize("install", INSTRUMENTS, ids=lambda f: f.__name__)
def test_an_agent_on_a_connection_instance_sees_the_claim(install: Any) -> None:
    traced: list[str] = []

    def instrument(sender: Any, connection: Any, **kwargs: Any) -> None:
        install(connection, traced)

    connection.close()
    connection_created.connect(instrument, weak=False)
    try:
        one_request()
    finally:
        connection_created.disconnect(instrument)
        connection.close()
    for name in ("create_cursor", "make_cursor"):  # the instance's patch undone
        vars(connections["default"]).pop(name, None)
    saw_each_statement_once(traced)
