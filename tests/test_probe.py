"""The readiness probe with the table and the cache up, and each one down.

Its problems are meant for a health endpoint anyone can call: the failures
below are real ones, whose error text names hosts, ports and roles, and
that text must reach the log and never the problems.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, connections, transaction
from django.db.utils import load_backend
from django.test.utils import override_settings

from idempotency_app.models import IdempotencyRecord
from idempotency_app.probe import ProbeResult, probe
from tests.conftest import needs_server_db

pytestmark = pytest.mark.django_db

TABLE = IdempotencyRecord._meta.db_table
ROLE = "probe_no_such_role"


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A local port that refuses connections: bound, so nothing else takes
    it, and not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@contextmanager
def database(alias: str, **config: Any) -> Iterator[None]:
    """A connection under an alias of its own, for probe() to read through
    IDEMPOTENCY["DATABASE_ALIAS"]. Made outside DATABASES, as Django's test
    cases allow, so its connecting is the driver's own and not refused."""
    settings_dict = {**connections.settings["default"], "OPTIONS": {}, **config}
    connections[alias] = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, alias)
    try:
        with override_settings(IDEMPOTENCY={"DATABASE_ALIAS": alias}):
            yield
    finally:
        connections[alias].close()
        del connections[alias]


def assert_kept_in_the_log(
    result: ProbeResult, caplog: pytest.LogCaptureFixture, level: str, leaks: list[str]
) -> None:
    """One problem, free of every leak; one log line at level, with the
    first leak in it (the others are in it when the driver says them)."""
    assert not result.ok
    assert len(result.problems) == 1
    for leak in leaks:
        assert leak not in result.problems[0]
    logged = [r for r in caplog.records if r.name == "idempotency_app"]
    assert [r.levelname for r in logged] == [level]
    assert leaks[0] in logged[0].getMessage()


def test_all_up() -> None:
    assert probe() == ProbeResult(ok=True, problems=[])


def test_redis_on_a_closed_port(closed_port: int, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("django_redis", reason="needs django-redis (the test extra)")
    down = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{closed_port}/0",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.1, "SOCKET_TIMEOUT": 0.1},
    }
    caches = {**settings.CACHES, "down": down}
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE_ALIAS": "down"}):
        result = probe()
    assert_kept_in_the_log(
        result, caplog, "WARNING", [f"127.0.0.1:{closed_port}", str(closed_port)]
    )
    assert result.problems == [
        "The cache 'down' does not answer. Requests still succeed, but a retried validation "
        "error runs the view again until the cache is back. Check that the cache server is "
        "reachable; the error is in the idempotency_app log."
    ]


@pytest.mark.parametrize(
    ("engine", "driver"),
    [("django.db.backends.postgresql", "psycopg"), ("django.db.backends.mysql", "MySQLdb")],
)
def test_database_on_a_closed_port(
    engine: str, driver: str, closed_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip(driver, reason=f"needs {driver} (the postgres or mysql extra)")
    with database("down", ENGINE=engine, HOST="127.0.0.1", PORT=str(closed_port), USER=ROLE):
        result = probe()
    assert_kept_in_the_log(result, caplog, "ERROR", ["127.0.0.1", str(closed_port), ROLE])
    assert result.problems == [
        "The idempotency table cannot be read on database 'down'. Check that the database is "
        "reachable and that migrations ran; the error is in the idempotency_app log."
    ]


@needs_server_db
def test_database_refusing_the_role(caplog: pytest.LogCaptureFixture) -> None:
    with database("stranger", USER=ROLE, PASSWORD="", NAME=connection.settings_dict["NAME"]):
        result = probe()
    assert_kept_in_the_log(result, caplog, "ERROR", [ROLE, connection.settings_dict["HOST"]])
    assert "database 'stranger'" in result.problems[0]


def test_cache_that_forgets() -> None:
    caches = {
        **settings.CACHES,
        "dummy": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"},
    }
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE_ALIAS": "dummy"}):
        result = probe()
    assert not result.ok
    assert result.problems == [
        "The cache 'dummy' did not return a value just written to it (a dummy cache, or errors "
        "ignored by its settings): the retry-storm guard cannot work."
    ]


def test_unknown_database_alias_is_reported_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with override_settings(IDEMPOTENCY={"DATABASE_ALIAS": "elsewhere"}):
        result = probe()
    assert not result.ok
    assert "cannot be read on database 'elsewhere'" in result.problems[0]
    assert "ConnectionDoesNotExist" in caplog.text


@pytest.mark.skipif(
    settings.DB == "mysql",
    reason="MySQL commits DDL at once: renaming the table cannot be rolled back",
)
def test_missing_table_is_reported_and_the_transaction_survives(user: User) -> None:
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {TABLE} RENAME TO probe_hidden")
        result = probe()
        # The failed read was inside a savepoint: the caller's transaction still works.
        assert User.objects.filter(pk=user.pk).exists()
        transaction.set_rollback(True)
    assert not result.ok
    assert len(result.problems) == 1
    assert result.problems[0].startswith(
        "The idempotency table cannot be read on database 'default'"
    )
    assert "migrations ran" in result.problems[0]
    assert not IdempotencyRecord.objects.exists()  # the table is back
