"""Real races on PostgreSQL and MariaDB: threads, processes, a killed worker
and a worker whose lease was taken over."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, connections
from django.test.utils import override_settings

from idempotency_app import clock
from idempotency_app.models import IdempotencyRecord
from tests.concurrency import fire_processes, fire_threads, post_as
from tests.conftest import needs_server_db
from tests.testapp import views
from tests.testapp.models import Charge, LedgerEntry

pytestmark = [needs_server_db, pytest.mark.django_db(transaction=True), pytest.mark.slow]

SLOW = {"label": "race", "amount": 7, "sleep": 0.5}


def _assert_one_execution(outcomes: list[int]) -> None:
    assert not [o for o in outcomes if o >= 500], outcomes
    assert outcomes.count(201) == 1, outcomes
    assert set(outcomes) <= {201, -201, 409}, outcomes
    assert Charge.objects.count() == 1
    assert LedgerEntry.objects.count() == 1


def test_threads_race_one_key(user: User, key: str) -> None:
    outcomes = fire_threads(16, user.pk, "/charges/", SLOW, key)
    assert len(outcomes) == 16
    _assert_one_execution(outcomes)
    assert outcomes.count(409) >= 1, "losers arriving during the slow view get 409"


def test_processes_race_one_key(user: User, key: str) -> None:
    outcomes = fire_processes(4, 4, user.pk, "/charges/", SLOW, key)
    assert len(outcomes) == 16
    _assert_one_execution(outcomes)


def test_mixin_view_race(user: User, key: str) -> None:
    outcomes = fire_processes(3, 3, user.pk, "/mixin-charges/", SLOW, key)
    _assert_one_execution(outcomes)


def test_waiting_duplicates_replay(user: User, key: str) -> None:
    # Generous, so that only a bug (never a slow machine) ends the wait.
    with override_settings(IDEMPOTENCY={"WAIT_FOR_IN_FLIGHT": 30}):
        outcomes = fire_threads(8, user.pk, "/charges/", SLOW, key)
    assert sorted(outcomes) == [-201] * 7 + [201], outcomes
    assert Charge.objects.count() == 1


def test_atomic_requests_race_waits_then_replays(user: User, key: str, monkeypatch: Any) -> None:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    outcomes = fire_threads(8, user.pk, "/charges/", SLOW, key)
    assert sorted(outcomes) == [-201] * 7 + [201], outcomes
    assert Charge.objects.count() == 1


def _slow_child(user_pk: int, key: str) -> None:
    post_as(user_pk, "/charges/", {"label": "doomed", "sleep": 60}, key)


def _wait_for(condition: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_killed_worker_leaves_no_partial_rows_and_runs_once_after_lease(
    user: User, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    connections.close_all()
    child = multiprocessing.get_context("fork").Process(target=_slow_child, args=(user.pk, key))
    child.start()
    try:
        _wait_for(lambda: IdempotencyRecord.objects.filter(key=key).exists())
        time.sleep(0.5)  # the child has written its Charge row and sleeps before the ledger entry
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=10)
    finally:
        if child.is_alive():
            child.kill()
    _wait_for(lambda: not _other_backends_active())
    assert Charge.objects.count() == 0, "the killed worker's uncommitted write must be gone"
    record = IdempotencyRecord.objects.get(key=key)
    assert record.status == "in_progress"

    assert post_as(user.pk, "/charges/", {"label": "doomed", "sleep": 60}, key) == 409
    # The same request (its body asks the view to sleep), run here without
    # the sleep: only the killed child needed to be slow.
    monkeypatch.setattr(views, "time", SimpleNamespace(sleep=lambda seconds: None))
    with clock.freeze(clock.now() + timedelta(seconds=61)):
        assert post_as(user.pk, "/charges/", {"label": "doomed", "sleep": 60}, key) == 201
    monkeypatch.undo()
    assert Charge.objects.count() == 1
    assert LedgerEntry.objects.count() == 1
    assert post_as(user.pk, "/charges/", {"label": "doomed", "sleep": 60}, key) == -201


def _other_backends_active() -> bool:
    """True while the killed child's session still exists on the server."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            )
        return bool(cursor.fetchone()[0])


def test_worker_whose_lease_was_taken_over_cannot_commit(user: User, key: str) -> None:
    body = {"label": "fenced", "amount": 3, "sleep": 1.5}
    first: list[int] = []

    def slow_worker() -> None:
        try:
            first.append(post_as(user.pk, "/charges/", body, key))
        finally:
            connections.close_all()

    thread = threading.Thread(target=slow_worker)
    thread.start()
    _wait_for(lambda: IdempotencyRecord.objects.filter(key=key).exists())
    original_token = IdempotencyRecord.objects.get(key=key).token
    with clock.freeze(clock.now() + timedelta(seconds=61)):
        # The lease looks lapsed: this request takes over and completes first.
        second = post_as(user.pk, "/charges/", body, key)
        thread.join(timeout=30)
    assert second == 201
    assert first == [409], "the fenced worker's client is told to retry"
    record = IdempotencyRecord.objects.get(key=key)
    assert record.status == "completed" and record.token != original_token
    assert Charge.objects.count() == 1, "the fenced worker's writes rolled back"
    assert LedgerEntry.objects.count() == 1
    assert post_as(user.pk, "/charges/", body, key) == -201
