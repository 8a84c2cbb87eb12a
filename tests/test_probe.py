"""The readiness probe with the table and the cache up, and each one down."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.test.utils import override_settings

from idempotency_app.models import IdempotencyRecord
from idempotency_app.probe import ProbeResult, probe

pytestmark = pytest.mark.django_db

CLOSED_PORT_REDIS = {
    "BACKEND": "django_redis.cache.RedisCache",
    "LOCATION": "redis://127.0.0.1:1/0",
    "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.1, "SOCKET_TIMEOUT": 0.1},
}
TABLE = IdempotencyRecord._meta.db_table


def test_all_up() -> None:
    assert probe() == ProbeResult(ok=True, problems=[])


def test_cache_down() -> None:
    caches = {**settings.CACHES, "down": CLOSED_PORT_REDIS}
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE_ALIAS": "down"}):
        result = probe()
    assert not result.ok
    assert len(result.problems) == 1
    assert result.problems[0].startswith("The cache 'down' does not answer (")
    assert "Requests still succeed" in result.problems[0]


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


def test_unknown_database_alias_is_reported_not_raised() -> None:
    with override_settings(IDEMPOTENCY={"DATABASE_ALIAS": "elsewhere"}):
        result = probe()
    assert not result.ok
    assert "cannot be read on database 'elsewhere'" in result.problems[0]


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
