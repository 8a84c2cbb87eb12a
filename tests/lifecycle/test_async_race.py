"""Real races on adrf async views through a real ASGI server: uvicorn with
two worker processes on PostgreSQL or MariaDB, copies of one request
released together from threads. Each test prints its figures (run with
-s to see them): requests, outcomes, executions, wall time."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User

from idempotency_app.models import IdempotencyRecord
from tests import servers
from tests.asgi_server import database_env, post_all, uvicorn_server
from tests.conftest import needs_server_db
from tests.testapp.models import Charge, LedgerEntry

pytest.importorskip("adrf", reason="needs adrf: pip install -e '.[test]'")

pytestmark = [needs_server_db, pytest.mark.django_db(transaction=True), pytest.mark.slow]

COPIES = 16
SLOW = {"label": "race", "amount": 7, "sleep": 0.5}


@pytest.fixture(scope="module")
def server(django_db_setup: Any, django_db_blocker: Any) -> Iterator[servers.AppServer]:
    with django_db_blocker.unblock(), uvicorn_server(database_env(), workers=2) as running:
        yield running


@pytest.fixture(scope="module")
def waiting_server(django_db_setup: Any, django_db_blocker: Any) -> Iterator[servers.AppServer]:
    settings = json.dumps({"WAIT_FOR_IN_FLIGHT": 20})
    env = {**database_env(), "IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY": settings}
    with django_db_blocker.unblock(), uvicorn_server(env, workers=2) as running:
        yield running


def outcomes(responses: list[Any]) -> Counter[str]:
    """201, 409, "201 replayed", or the error a request raised."""
    counted: Counter[str] = Counter()
    for response in responses:
        if isinstance(response, Exception):
            counted[type(response).__name__] += 1
        elif response.headers.get("Idempotent-Replayed") == "true":
            counted[f"{response.status} replayed"] += 1
        else:
            counted[str(response.status)] += 1
    return counted


def race(server: servers.AppServer, path: str, body: Any = SLOW) -> tuple[Counter[str], float]:
    key = str(uuid.uuid4())
    started = time.monotonic()
    responses = post_all(server.url, path, body, key, COPIES)
    elapsed = time.monotonic() - started
    counted = outcomes(responses)
    print(
        f"\nRACE {path} on {server.env['IDEMPOTENCY_TEST_DB']}: {COPIES} requests, "
        f"outcomes {dict(counted)}, executions {Charge.objects.count()}, {elapsed:.2f} s"
    )
    return counted, elapsed


def assert_one_execution(counted: Counter[str]) -> None:
    assert counted["201"] == 1, counted
    assert set(counted) <= {"201", "409", "201 replayed"}, counted
    assert Charge.objects.count() == 1
    assert LedgerEntry.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == "completed"


@pytest.mark.parametrize(
    "path", ["/async/charges/", "/async/mixin-charges/", "/async/viewset-charges/"]
)
def test_copies_race_one_execution(server: servers.AppServer, user: User, path: str) -> None:
    counted, _ = race(server, path)
    assert_one_execution(counted)
    assert counted["409"] >= 1, "copies arriving during the slow view get 409"


def test_waiting_copies_all_get_the_one_result(
    waiting_server: servers.AppServer, user: User
) -> None:
    counted, elapsed = race(waiting_server, "/async/charges/")
    assert counted == Counter({"201": 1, "201 replayed": COPIES - 1}), counted
    assert_one_execution(counted)
    assert elapsed < 15


def test_distinct_keys_run_in_parallel(server: servers.AppServer, user: User) -> None:
    """A unit holds its request's thread while the coroutine awaits; the
    event loop and the other requests' threads stay free."""
    body = {"label": "parallel", "sleep": 0.5}
    started = time.monotonic()
    responses = [
        response
        for response in post_all_distinct(server.url, "/async/charges/", body, 32)
        if not isinstance(response, Exception)
    ]
    elapsed = time.monotonic() - started
    print(
        f"\nPARALLEL 32 distinct keys, each awaiting 0.5 s, on {server.env['IDEMPOTENCY_TEST_DB']}:"
        f" {elapsed:.2f} s (serialised: 16 s)"
    )
    assert [r.status for r in responses] == [201] * 32
    assert Charge.objects.count() == 32
    assert elapsed < 8, "requests were serialised"


def post_all_distinct(url: str, path: str, body: Any, count: int) -> list[Any]:
    from tests.concurrency import in_threads

    return in_threads(count, lambda: servers.post(url, path, body, str(uuid.uuid4()), timeout=60))
