"""The retry-storm guard, against the configured cache (real Redis when
IDEMPOTENCY_TEST_REDIS_URL is set) and against a dead Redis (a closed port)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.cache import caches
from django.test.utils import override_settings
from rest_framework.test import APIClient

from idempotency_app import clock, guard as guard_module, signals
from idempotency_app.guard import TransientErrorCache, decode, encode
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity, StoredResponse
from tests.concurrency import fire_processes
from tests.conftest import claims, needs_redis, needs_server_db, post

pytestmark = pytest.mark.django_db(transaction=True)

INVALID = {"raise": "validation"}
DEAD_REDIS = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "dead": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:1/0",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.2, "SOCKET_TIMEOUT": 0.2},
    },
}


def test_retry_inside_window_gets_cached_400(
    api: APIClient, key: str, executions: list[int]
) -> None:
    first = post(api, "/charges/", INVALID, key)
    second = post(api, "/charges/", INVALID, key)
    assert first.status_code == second.status_code == 400
    assert second["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert second.content == first.content
    assert second["Content-Type"] == first["Content-Type"]
    assert executions == [400], "the view ran once"
    assert not claims().exists(), "the claim was released"


def test_after_the_window_the_view_runs_again(
    api: APIClient, key: str, executions: list[int]
) -> None:
    with override_settings(IDEMPOTENCY={"TRANSIENT_ERROR_TTL": 0.5}):
        post(api, "/charges/", INVALID, key)
        time.sleep(0.7)
        again = post(api, "/charges/", INVALID, key)
    assert again.status_code == 400 and "Idempotent-Replayed" not in again
    assert executions == [400, 400]


def test_guard_off_when_ttl_is_zero(api: APIClient, key: str, executions: list[int]) -> None:
    with override_settings(IDEMPOTENCY={"TRANSIENT_ERROR_TTL": 0}):
        post(api, "/charges/", INVALID, key)
        post(api, "/charges/", INVALID, key)
    assert executions == [400, 400]


def test_corrected_request_is_judged_normally(api: APIClient, key: str) -> None:
    post(api, "/charges/", INVALID, key)
    fixed = post(api, "/charges/", {"label": "fixed"}, key)
    assert fixed.status_code == 201 and "Idempotent-Replayed" not in fixed
    assert post(api, "/charges/", {"label": "fixed"}, key)["Idempotent-Replayed"] == "true"


def test_guard_is_per_scope(
    api: APIClient, other_user: User, key: str, executions: list[int]
) -> None:
    post(api, "/charges/", INVALID, key)
    other = APIClient()
    other.force_authenticate(other_user)
    theirs = post(other, "/charges/", INVALID, key)
    assert "Idempotent-Replayed" not in theirs
    assert executions == [400, 400]


def test_guard_hit_signal(api: APIClient, key: str) -> None:
    hits: list[Identity] = []

    def on_hit(sender: Any, identity: Identity, **kwargs: Any) -> None:
        hits.append(identity)

    signals.guard_hit.connect(on_hit, weak=False)
    try:
        post(api, "/charges/", INVALID, key)
        post(api, "/charges/", INVALID, key)
    finally:
        signals.guard_hit.disconnect(on_hit)
    assert [h.key for h in hits] == [key]


def test_value_is_compact_versioned_json() -> None:
    stored = StoredResponse(400, (("Content-Type", "application/json"),), b'{"amount":["bad"]}')
    raw = encode(stored)
    assert json.loads(raw)["v"] == 1
    assert decode(raw) == stored
    assert decode(raw.encode()) == stored
    assert decode('{"v": 99}') is None
    assert decode(b"\x80\x04garbage") is None


@needs_redis
def test_redis_holds_plain_json_not_pickle(api: APIClient, key: str) -> None:
    post(api, "/charges/", INVALID, key)
    cache = caches["default"]
    client = cache.client.get_client()
    raw_keys = client.keys(cache.make_key("idempotency:transient:*"))
    assert len(raw_keys) == 1
    value = client.get(raw_keys[0])
    assert json.loads(value)["s"] == 400
    ttl_ms = client.pttl(raw_keys[0])
    assert 0 < ttl_ms <= 10_000


def test_dead_cache_fails_open_and_warns_once(
    api: APIClient, key: str, executions: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idempotency_app")
    with override_settings(
        CACHES=DEAD_REDIS, IDEMPOTENCY={"CACHE_ALIAS": "dead", "CACHE_RETRY_INTERVAL": 60}
    ):
        codes = [post(api, "/charges/", INVALID, key).status_code for _ in range(5)]
        ok = post(api, "/charges/", {"label": "fine"}, key)
    assert codes == [400] * 5
    assert ok.status_code == 201
    assert len(executions) == 6, "without the guard every retry runs the view"
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1, "one timeout, then the guard stays off for the interval"


def test_guard_comes_back_after_the_interval() -> None:
    identity = Identity("user:1", "k", "POST x", "f")
    stored = StoredResponse(400, (), b"{}")
    probe = TransientErrorCache()
    now = [1000.0]
    probe.timer = lambda: now[0]  # type: ignore[method-assign]
    with override_settings(
        CACHES=DEAD_REDIS, IDEMPOTENCY={"CACHE_ALIAS": "dead", "CACHE_RETRY_INTERVAL": 5}
    ):
        assert probe.get(identity) is None  # fails, trips the breaker
    now[0] += 1
    probe.set(identity, stored)
    assert probe.get(identity) is None, "still inside the interval: skipped"
    now[0] += 5
    probe.set(identity, stored)
    assert probe.get(identity) == stored, "after the interval the guard works again"


@needs_server_db
@needs_redis
@pytest.mark.slow
def test_burst_of_invalid_retries_runs_the_view_once_per_window(user: User, key: str) -> None:
    counter = multiprocessing.get_context("fork").Value("i", 0)

    def count(sender: Any, **kwargs: Any) -> None:
        with counter.get_lock():
            counter.value += 1

    signals.executed.connect(count, weak=False)
    try:
        # A window wide enough for both bursts however slow the machine forks.
        with override_settings(IDEMPOTENCY={"TRANSIENT_ERROR_TTL": 60}):
            outcomes = fire_processes(3, 4, user.pk, "/charges/", {**INVALID, "sleep": 0}, key)
            outcomes += fire_processes(3, 4, user.pk, "/charges/", {**INVALID, "sleep": 0}, key)
    finally:
        signals.executed.disconnect(count)
    assert not [o for o in outcomes if o >= 500], outcomes
    assert set(outcomes) <= {400, -400, 409}, outcomes
    assert counter.value == 1, f"{counter.value} executions for one window: {outcomes}"


@needs_server_db
@pytest.mark.slow
def test_burst_with_dead_cache_still_gets_clean_400s(user: User, key: str) -> None:
    with override_settings(CACHES=DEAD_REDIS, IDEMPOTENCY={"CACHE_ALIAS": "dead"}):
        outcomes = fire_processes(3, 4, user.pk, "/charges/", INVALID, key)
    assert not [o for o in outcomes if o >= 500], outcomes
    assert set(outcomes) <= {400, 409}, outcomes
    assert outcomes.count(400) >= 1


def guard_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every read of the guard's cache, by cache key."""
    reads: list[str] = []
    real = guard_module.guard._raw_get

    def counted(key: str) -> Any:
        reads.append(key)
        return real(key)

    monkeypatch.setattr(guard_module.guard, "_raw_get", counted)
    return reads


def test_a_fresh_request_never_reads_the_guard(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = guard_reads(monkeypatch)
    assert post(api, "/charges/", {"label": "a"}, key).status_code == 201
    assert post(api, "/charges/", {"label": "a"}, key)["Idempotent-Replayed"] == "true"
    assert reads == [], "only a claim that meets a validation error's marker asks the cache"


def test_only_a_retry_inside_a_validation_errors_window_reads_the_guard(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = guard_reads(monkeypatch)
    assert post(api, "/charges/", {"raise": "validation"}, key).status_code == 400
    assert reads == []
    assert post(api, "/charges/", {"raise": "validation"}, key)["Idempotent-Replayed"] == "true"
    assert len(reads) == 1
    fixed = post(api, "/charges/", {"label": "fixed"}, key)
    assert fixed.status_code == 201 and "Idempotent-Replayed" not in fixed
    assert len(reads) == 2, "the corrected request asks once, misses, and runs"
    assert IdempotencyRecord.objects.get().status == "completed"
    assert post(api, "/charges/", {"label": "fixed"}, key)["Idempotent-Replayed"] == "true"
    assert len(reads) == 2, "a replay never asks"


def test_a_client_alternating_two_bad_bodies_is_still_guarded(
    api: APIClient, key: str, executions: list[int]
) -> None:
    """Each body's 400 leaves the marker the other one meets: the guard is
    asked whatever body left it, and answers for the body it cached."""
    answers = [post(api, "/charges/", {"raise": "validation", "n": n % 2}, key) for n in range(6)]
    assert [a.status_code for a in answers] == [400] * 6
    assert executions == [400, 400], "each body ran once; its retries got its cached 400"
    assert [a.get("Idempotent-Replayed") for a in answers] == [None, None] + ["true"] * 4


def test_after_the_window_the_marker_is_taken_over_without_asking(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = guard_reads(monkeypatch)
    with clock.freeze():
        post(api, "/charges/", {"raise": "validation"}, key)
        clock.advance(11)
        again = post(api, "/charges/", {"raise": "validation"}, key)
    assert again.status_code == 400 and "Idempotent-Replayed" not in again
    assert reads == []


@override_settings(IDEMPOTENCY={"TRANSIENT_ERROR_TTL": 0})
def test_no_guard_no_marker(api: APIClient, key: str) -> None:
    assert post(api, "/charges/", {"raise": "validation"}, key).status_code == 400
    assert not IdempotencyRecord.objects.exists()
