"""The statement guard's cursor class (``lifecycle.work._guarded_cursor``,
cached per driver class for the life of the process) captured the
driver's ``execute`` when the class was made, and called that function
ever after. An agent that patches ``psycopg.Cursor.execute`` (or
mysqlclient's ``Cursor.execute``) on the class after the process's first
connection (OpenTelemetry-style instrumentation enabled late, a
profiler attached to a running worker) was then bypassed for every
statement Django sends, inside work or not: it saw nothing at all.

The guarantee: the guarded class calls the driver class's method as
it is when the statement runs (``super().execute``), so the agent sees
Django's statements (and then, by the agent checks, the library's)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connections

from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]


def test_an_agent_patching_the_driver_execute_after_the_first_connection_sees_statements() -> None:
    connection = connections["default"]
    connection.ensure_connection()  # the process's guarded class made (or made long ago)
    connection.close()
    if connection.vendor == "postgresql":
        import psycopg

        target = psycopg.Cursor
    else:
        import MySQLdb.cursors

        target = MySQLdb.cursors.BaseCursor
    traced: list[str] = []
    original = target.execute

    def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        traced.append(str(query))
        return original(self, query, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(target, "execute", execute)
        try:
            Charge.objects.create(label="seen")
        finally:
            connection.close()
    assert any("INSERT" in sql for sql in traced), traced
