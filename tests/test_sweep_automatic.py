"""AUTO_SWEEP_INTERVAL: a bounded sweep after a request, once per interval
across processes, off by default."""

from __future__ import annotations

import io
import multiprocessing
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished
from django.db import DatabaseError, connection, connections, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings

from idempotency_app import clock, service, sweep
from idempotency_app.models import IdempotencyRecord
from tests.conftest import needs_server_db
from tests.test_sweep import IN_PROGRESS, LEASE, NOW, keys, make

pytestmark = pytest.mark.django_db(transaction=True)

INTERVAL = 300
AUTO_SWEEP_UID = "idempotency_app.auto_sweep"


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a process that has never swept."""
    monkeypatch.setattr(sweep, "_next_attempt", 0.0)


def request(at: Any = NOW) -> int:
    """Any request will do: the sweep runs once its response has gone out."""
    with clock.freeze(at):
        return Client().get("/any-page/").status_code


def sweep_records() -> list[IdempotencyRecord]:
    return list(IdempotencyRecord.objects.filter(scope=sweep.AUTO_SWEEP_SCOPE))


def failing(message: str) -> Callable[..., Any]:
    """A stand-in for a sweep step whose database gave up."""

    def fail(*args: Any) -> Any:
        raise DatabaseError(message)

    return fail


def user_keys() -> set[str]:
    return {k for k in keys() if not k.startswith("sweep:")}


@pytest.fixture
def mixed() -> None:
    make("expired", expires_in=-1)
    make("stale", IN_PROGRESS, lease_left=-LEASE - 1)
    make("live", expires_in=60)
    make("live-claim", IN_PROGRESS, lease_left=30)


def test_off_by_default(mixed: None) -> None:
    with CaptureQueriesContext(connection) as queries:
        request()
    assert user_keys() == {"expired", "stale", "live", "live-claim"}
    assert not [q for q in queries.captured_queries if "idempotency" in q["sql"]]


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_a_request_sweeps_expired_records_and_stale_claims(mixed: None) -> None:
    assert request() == 404, "the request itself is answered as usual"
    assert user_keys() == {"live", "live-claim"}
    [record] = sweep_records()
    assert record.status == "completed"
    with clock.freeze(NOW):
        entry = service.lookup(sweep.AUTO_SWEEP_SCOPE, record.key)
    assert entry is not None and entry.operation == sweep.AUTO_SWEEP_OPERATION
    assert entry.result == {"expired": 1, "stale": 1}


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_one_round_per_interval_however_many_processes() -> None:
    request()
    make("expired-later", expires_in=-1)
    request(NOW + timedelta(seconds=10))
    assert "expired-later" in user_keys(), "this process waits out its interval"
    sweep._next_attempt = 0.0  # another process, which has not swept yet
    request(NOW + timedelta(seconds=20))
    assert "expired-later" in user_keys(), "the interval's round was taken"
    request(NOW + timedelta(seconds=INTERVAL + 20))
    assert "expired-later" not in user_keys(), "a new interval, a new round"
    request(NOW + timedelta(seconds=3 * INTERVAL))
    assert len(sweep_records()) == 1, "each round deletes the records of rounds before"


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_a_round_deletes_one_batch_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep, "DEFAULT_BATCH", 2)
    for n in range(3):
        make(f"expired-{n}", expires_in=-1)
    request()
    assert len(user_keys()) == 1


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_a_failing_sweep_is_logged_and_the_next_interval_tries_again(
    mixed: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(sweep, "auto_sweep", failing("connection lost"))
        assert request() == 404
    assert "The automatic idempotency sweep failed" in caplog.text
    assert "connection lost" in caplog.text
    request(NOW + timedelta(seconds=1))
    assert "expired" in user_keys(), "no retry on every request after a failure"
    request(NOW + timedelta(seconds=INTERVAL))
    assert "expired" not in user_keys()


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL, "ENABLED": False})
def test_disabled_means_nothing_is_read_or_written(mixed: None) -> None:
    request()
    assert user_keys() == {"expired", "stale", "live", "live-claim"}
    assert not sweep_records()


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": "5 minutes"})
def test_a_malformed_interval_never_fails_a_request(caplog: pytest.LogCaptureFixture) -> None:
    assert request() == 404
    assert "The automatic idempotency sweep failed" in caplog.text


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_a_failed_round_gives_its_interval_back(
    mixed: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(sweep, "batches", failing("statement timeout"))
        request()
    assert "statement timeout" in caplog.text
    assert not sweep_records(), "no round left in progress for the admin to show as stuck"
    sweep._next_attempt = 0.0  # another process, in the same interval
    request(NOW + timedelta(seconds=1))
    assert user_keys() == {"live", "live-claim"}


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_no_round_inside_an_open_transaction(mixed: None) -> None:
    with transaction.atomic():
        request()
        assert not sweep_records()
    assert "expired" in user_keys()
    request()
    assert "expired" not in user_keys(), "the next request outside it sweeps"


@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_a_clock_stepped_back_does_not_stall_the_process(mixed: None) -> None:
    request(NOW + timedelta(days=1))
    make("expired-later", expires_in=-1)
    request()
    assert "expired-later" not in user_keys()


@needs_server_db
@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_the_rounds_connection_is_closed_like_the_requests(mixed: None) -> None:
    """Through the real WSGI handler: Django's own receiver closes the
    request's connections before the round opens one."""
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/any-page/",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(),
    }
    # As in a server process: Django's receiver first, ours after it. (The
    # test client moves Django's to the end each time it is used.)
    request_finished.disconnect(dispatch_uid=AUTO_SWEEP_UID)
    request_finished.connect(sweep.sweep_after_request, dispatch_uid=AUTO_SWEEP_UID)
    with clock.freeze(NOW):
        response = WSGIHandler()(environ, lambda status, headers: None)
        response.close()
    assert connection.connection is None, "the round closed its connection"
    assert user_keys() == {"live", "live-claim"}, "after it ran"


def _round_in_child(start: Any, outcomes: Any) -> None:
    try:
        start.wait(30)
        outcomes.put(sweep.auto_sweep(NOW, INTERVAL))
    except Exception as exc:
        outcomes.put(repr(exc))
    finally:
        connections.close_all()


@needs_server_db
@pytest.mark.slow
@override_settings(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": INTERVAL})
def test_processes_racing_for_one_interval_sweep_once(mixed: None) -> None:
    context = multiprocessing.get_context("fork")
    connections.close_all()  # a child closing an inherited connection would end ours
    start, outcomes = context.Event(), context.Queue()
    with clock.freeze(NOW):
        children = [
            context.Process(target=_round_in_child, args=(start, outcomes)) for _ in range(6)
        ]
        for child in children:
            child.start()
        start.set()
        results = [outcomes.get(timeout=60) for _ in children]
        for child in children:
            child.join(10)
    rounds = [r for r in results if r is not None]
    assert rounds == [{"expired": 1, "stale": 1}], results
    assert user_keys() == {"live", "live-claim"}
    assert len(sweep_records()) == 1
