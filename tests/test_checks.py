from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import django
import pytest
from django.test.utils import override_settings

from idempotency_app.checks import check_settings

pytestmark = pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")


def ids(**settings: Any) -> set[str]:
    with override_settings(**settings):
        return {message.id for message in check_settings()}


def test_defaults_pass() -> None:
    assert {i for i in ids() if ".E" in i} == set()


def test_not_a_dict() -> None:
    assert ids(IDEMPOTENCY=[("TTL", 60)]) == {"idempotency_app.E001"}


def test_unknown_key_is_an_error_naming_it() -> None:
    with override_settings(IDEMPOTENCY={"TTLL": 60}):
        [message] = [m for m in check_settings() if m.is_serious()]
    assert message.id == "idempotency_app.E002"
    assert "TTLL" in message.msg


@pytest.mark.parametrize("name", ["TTL", "AUTO_SWEEP_INTERVAL"])
@pytest.mark.parametrize("value", ["60", None, True])
def test_duration_must_be_a_number_or_timedelta(name: str, value: Any) -> None:
    assert "idempotency_app.E003" in ids(IDEMPOTENCY={name: value})


@pytest.mark.parametrize(
    ("ttl", "ok"), [(59, False), (60, True), (timedelta(days=30), True), (30 * 86400 + 1, False)]
)
def test_ttl_bounds(ttl: Any, ok: bool) -> None:
    assert ("idempotency_app.E004" not in ids(IDEMPOTENCY={"TTL": ttl, "LEASE": 30})) is ok


@pytest.mark.parametrize(("lease", "ok"), [(0.5, False), (1, True), (3599, True), (3600, False)])
def test_lease_bounds(lease: float, ok: bool) -> None:
    assert ("idempotency_app.E005" not in ids(IDEMPOTENCY={"TTL": 3600, "LEASE": lease})) is ok


@pytest.mark.parametrize(
    "name",
    ["TRANSIENT_ERROR_TTL", "WAIT_FOR_IN_FLIGHT", "CACHE_RETRY_INTERVAL", "AUTO_SWEEP_INTERVAL"],
)
def test_negative_or_endless_durations(name: str) -> None:
    for bad in (-1, math.nan, math.inf):
        assert "idempotency_app.E006" in ids(IDEMPOTENCY={name: bad}), bad
    assert "idempotency_app.E006" not in ids(IDEMPOTENCY={name: 0})


@pytest.mark.parametrize(("interval", "ok"), [(0, True), (0.5, False), (1, True), (3600, True)])
def test_auto_sweep_interval_is_off_or_at_least_a_second(interval: float, ok: bool) -> None:
    assert ("idempotency_app.E016" not in ids(IDEMPOTENCY={"AUTO_SWEEP_INTERVAL": interval})) is ok


@pytest.mark.parametrize(
    ("seconds", "error"),
    [(0, None), (2.5, None), (60, None), (61, "E021"), (-1, "E006"), ("5s", "E003")],
)
def test_replay_cache_is_a_few_seconds_at_most(seconds: Any, error: str | None) -> None:
    found = {
        i for i in ids(IDEMPOTENCY={"REPLAY_CACHE": seconds}) if i[-4:] in ("E003", "E006", "E021")
    }
    assert found == ({f"idempotency_app.{error}"} if error else set())


@pytest.mark.parametrize(("entries", "ok"), [(1, True), (1000, True), (0, False), (2.5, False)])
def test_replay_cache_entries_is_a_whole_number(entries: Any, ok: bool) -> None:
    assert ("idempotency_app.E022" not in ids(IDEMPOTENCY={"REPLAY_CACHE_ENTRIES": entries})) is ok


def test_wait_must_be_shorter_than_lease() -> None:
    assert "idempotency_app.E007" in ids(IDEMPOTENCY={"LEASE": 10, "WAIT_FOR_IN_FLIGHT": 10})


@pytest.mark.parametrize("value", [-1, "1mb", 1.5, None])
def test_body_limit_must_be_whole_bytes(value: Any) -> None:
    assert "idempotency_app.E008" in ids(IDEMPOTENCY={"MAX_BODY_BYTES": value})


def test_cache_alias_must_exist() -> None:
    assert "idempotency_app.E009" in ids(IDEMPOTENCY={"CACHE_ALIAS": "nope"})


def test_database_alias_must_exist() -> None:
    assert "idempotency_app.E010" in ids(IDEMPOTENCY={"DATABASE_ALIAS": "nope"})


def test_scope_must_import() -> None:
    assert "idempotency_app.E011" in ids(IDEMPOTENCY={"SCOPE": "nowhere.scope"})
    assert "idempotency_app.E011" in ids(IDEMPOTENCY={"FINGERPRINT": 42})
    assert "idempotency_app.E011" not in ids(IDEMPOTENCY={"SCOPE": lambda request: "x"})


def test_atomic_requests_warns() -> None:
    from django.conf import settings

    databases = {"default": {**settings.DATABASES["default"], "ATOMIC_REQUESTS": True}}
    assert "idempotency_app.W001" in ids(DATABASES=databases)


SERVER_DB = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x"}}
LOCMEM = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
REDIS = {
    "default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": "redis://127.0.0.1:6379/0"}
}


def test_local_memory_cache_with_server_database_warns() -> None:
    assert "idempotency_app.W002" in ids(DATABASES=SERVER_DB, CACHES=LOCMEM)
    assert "idempotency_app.W002" not in ids(DATABASES=SERVER_DB, CACHES=REDIS)
    sqlite = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    assert "idempotency_app.W002" not in ids(DATABASES=sqlite, CACHES=LOCMEM)


@pytest.mark.skipif(django.VERSION < (5, 1), reason="transaction_mode needs Django 5.1+")
def test_sqlite_without_immediate_transactions_warns() -> None:
    deferred = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    immediate = {"default": {**deferred["default"], "OPTIONS": {"transaction_mode": "IMMEDIATE"}}}
    assert "idempotency_app.W003" in ids(DATABASES=deferred, CACHES=LOCMEM)
    assert "idempotency_app.W003" not in ids(DATABASES=immediate, CACHES=LOCMEM)
