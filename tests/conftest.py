from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.core.cache import caches
from django.db import connections
from django.test import Client
from django.test.utils import override_settings
from rest_framework.test import APIClient

from idempotency_app import guard as guard_module, service, signals
from idempotency_app.lifecycle import replays
from idempotency_app.models import IdempotencyRecord
from tests.testapp.models import Charge

SERVER_DB = settings.DB != "sqlite"

# The services a test may need, each a marker (declared in pyproject.toml):
# whether this run has it, and why the test is skipped when it has not.
SERVICES: dict[str, tuple[bool, str]] = {
    "server_db": (
        SERVER_DB,
        "needs PostgreSQL or MariaDB: set IDEMPOTENCY_TEST_DB=postgres or mysql",
    ),
    "postgresql": (settings.DB == "postgres", "needs PostgreSQL: set IDEMPOTENCY_TEST_DB=postgres"),
    "mysql": (settings.DB == "mysql", "needs MariaDB or MySQL: set IDEMPOTENCY_TEST_DB=mysql"),
    "redis": (
        bool(settings.REDIS_URL),
        "needs Redis: set IDEMPOTENCY_TEST_REDIS_URL=redis://127.0.0.1:6379/0",
    ),
    "faults": (
        os.environ.get("IDEMPOTENCY_FAULT_TESTS") == "1",
        "set IDEMPOTENCY_FAULT_TESTS=1 to run the fault-injection tests (they start their own "
        "servers)",
    ),
}
needs_server_db = pytest.mark.server_db
needs_redis = pytest.mark.redis


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip, saying why, a test whose service this run does not have."""
    for marker in item.iter_markers():
        available, reason = SERVICES.get(marker.name, (True, ""))
        if not available:
            pytest.skip(reason)


@pytest.fixture(autouse=True)
def _fresh_cache_state() -> Iterator[None]:
    """Each test starts with an empty cache and a guard that is not tripped.

    On Redis only this run's keys go (its KEY_PREFIX): ``clear()`` would
    flush the database under other test runs sharing the server.
    """
    cache = caches["default"]
    if hasattr(cache, "delete_pattern"):
        cache.delete_pattern("*")
    else:
        cache.clear()
    guard_module._down_until = 0.0
    replays.clear()
    yield
    guard_module._down_until = 0.0
    replays.clear()


@pytest.fixture
def user(db: Any) -> User:
    return User.objects.create_user("alice", password="pw")


@pytest.fixture
def other_user(db: Any) -> User:
    return User.objects.create_user("bob", password="pw")


@pytest.fixture
def api(user: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def quiet_api(user: User) -> APIClient:
    """A client that gets the 500 a server would send, not the exception."""
    client = APIClient(raise_request_exception=False)
    client.force_authenticate(user)
    return client


@pytest.fixture
def executions() -> Iterator[list[int]]:
    """The status of every execution that ran while the test did."""
    runs: list[int] = []

    def count(sender: Any, status: int, **kwargs: Any) -> None:
        runs.append(status)

    signals.executed.connect(count, weak=False)
    yield runs
    signals.executed.disconnect(count)


@pytest.fixture
def key() -> str:
    return str(uuid.uuid4())


def claims() -> Any:
    """Records that hold or held work: not the markers a validation error
    leaves for TRANSIENT_ERROR_TTL, which stand for no claim."""
    return IdempotencyRecord.objects.exclude(status=IdempotencyRecord.Status.RELEASED)


def operator(user: User) -> Client:
    """An admin client for ``user``, made staff with the permissions that
    release and expire records."""
    user.is_staff = True
    user.save()
    user.user_permissions.set(
        Permission.objects.filter(
            codename__in=["view_idempotencyrecord", "delete_idempotencyrecord"]
        )
    )
    admin = Client()
    admin.force_login(user)
    return admin


def replay_cache(seconds: float = 5, **more: Any) -> Any:
    """Settings with REPLAY_CACHE on (and any other IDEMPOTENCY keys)."""
    return override_settings(
        IDEMPOTENCY={**getattr(settings, "IDEMPOTENCY", {}), "REPLAY_CACHE": seconds, **more}
    )


def once_in(scope: str, operation: str) -> Callable[..., tuple[bool, Any]]:
    """``service.once`` in ``scope`` for a test module's work: called with a
    key and the work, it answers whether the work ran and the result every
    copy gets."""

    def once(key: str, work: Any, **options: Any) -> tuple[bool, Any]:
        ran = False
        with service.once(scope, key, operation, **options) as run:
            if run.should_execute:
                ran = True
                run.result = work()
        return ran, run.result

    return once


def new_key() -> str:
    return str(uuid.uuid4())


def charge_labels() -> list[str]:
    """The labels of every Charge written, sorted: what committed."""
    return sorted(Charge.objects.values_list("label", flat=True))


def post(client: APIClient, url: str, data: Any, key: str | None, **extra: Any) -> Any:
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return client.post(url, data, format="json", **headers, **extra)


def session_id() -> int:
    """The server session behind the default connection."""
    with connections["default"].cursor() as cursor:
        if connections["default"].vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
        else:
            cursor.execute("SELECT CONNECTION_ID()")
        return int(cursor.fetchone()[0])


def end_session(session: int) -> None:
    """End a server session from another connection, as a database restart
    does to every open connection."""
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            if other.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [session])
            else:
                cursor.execute(f"KILL {int(session)}")
    finally:
        other.close()
