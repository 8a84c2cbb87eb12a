"""A duplicate that waits for an in-flight claim with autocommit off (a
transaction managed by hand, outside ``atomic``) must not hold the key's
row while it polls: the worker completing it would wait on that lock until
the poller gave up (409), or past its own lock timeout and lose its work."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection, connections, transaction

from idempotency_app import service
from tests.conftest import needs_server_db

pytestmark = [needs_server_db, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("lock_timeout", [None, 1], ids=["server-default", "1s"])
def test_a_poller_with_autocommit_off_gets_the_workers_result(
    key: str, lock_timeout: int | None
) -> None:
    if lock_timeout is not None and connection.vendor != "mysql":
        pytest.skip("a session lock timeout of MariaDB's")
    started = threading.Event()
    worker: dict[str, Any] = {}

    def run_the_work() -> None:
        try:
            if lock_timeout is not None:
                with connection.cursor() as cursor:
                    cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {lock_timeout}")
            with service.once("tenant", key, "op") as run:
                started.set()
                time.sleep(0.3)
                run.result = "done"
            worker["finished"] = time.monotonic()
        except Exception as exc:  # reported by the assertion below
            worker["failed"] = exc
            started.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run_the_work)
    thread.start()
    assert started.wait(10)
    asked = time.monotonic()
    transaction.set_autocommit(False)
    try:
        outcome = service.claim("tenant", key, "op", wait=3)
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    thread.join(30)
    assert "failed" not in worker, worker
    assert worker["finished"] - asked < 2, "the worker's completion waited for the poller"
    assert isinstance(outcome, service.Done) and outcome.result == "done", outcome
