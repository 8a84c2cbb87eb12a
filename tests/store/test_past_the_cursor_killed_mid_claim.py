"""A backend terminated while the claim runs: the server's FATAL error
(57P01, admin_shutdown) arrives before the connection closes. The claim
past the cursor raises what psycopg's cursor raises,
``psycopg.errors.AdminShutdown`` with its SQLSTATE, under Django's
``OperationalError``: what a ``store_unavailable`` receiver, an error
tracker or code reading ``exc.__cause__`` is handed."""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

import pytest
from django.db import OperationalError, connection

from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import backend
from idempotency_app.store.base import Identity

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def _killed_mid_claim(through_cursor: bool) -> Any:
    import psycopg

    connection.ensure_connection()
    pid = connection.connection.info.backend_pid
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    locker = psycopg.connect(**params)
    locker.execute(f"LOCK TABLE {IdempotencyRecord._meta.db_table} IN ACCESS EXCLUSIVE MODE")
    killer = psycopg.connect(**params, autocommit=True)
    timer = threading.Timer(0.5, lambda: killer.execute("SELECT pg_terminate_backend(%s)", [pid]))
    timer.start()
    wrap = (
        connection.execute_wrapper(lambda execute, *args: execute(*args))
        if through_cursor
        else contextlib.nullcontext()
    )
    try:
        with pytest.raises(OperationalError) as raised, wrap:
            backend("default").claim(Identity("s", str(uuid.uuid4()), "op", "f"), "t", 60, 30)
    finally:
        timer.join()
        locker.close()
        killer.close()
        connection.close()
    cause = raised.value.__cause__
    return type(cause), getattr(cause, "sqlstate", None)


def test_a_backend_killed_mid_claim_raises_what_the_cursor_raises() -> None:
    import psycopg

    through_cursor = _killed_mid_claim(True)
    assert through_cursor == (psycopg.errors.AdminShutdown, "57P01")
    assert _killed_mid_claim(False) == through_cursor
