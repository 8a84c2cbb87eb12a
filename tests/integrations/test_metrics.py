"""Prometheus metrics from the signals: counters by outcome and operation,
the claim histogram, and the example project's /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import DatabaseError
from django.dispatch import Signal
from django.test.utils import override_settings
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from idempotency_app import clock, service, signals, store
from idempotency_app.lifecycle.claims import Claim
from idempotency_app.store import Identity
from tests.conftest import post

pytestmark = pytest.mark.django_db(transaction=True)

OPERATION = "POST charges/"


def outcome(name: str, operation: str = OPERATION) -> float:
    value = REGISTRY.get_sample_value(
        "idempotency_outcomes_total", {"outcome": name, "operation": operation}
    )
    return value or 0.0


def claims(decision: str) -> float:
    return (
        REGISTRY.get_sample_value("idempotency_claim_seconds_count", {"decision": decision}) or 0.0
    )


class Delta:
    """Counters' growth over a block."""

    def __init__(self, read: dict[str, Any]) -> None:
        self.read = read
        self.before = {name: get() for name, get in read.items()}

    def __call__(self) -> dict[str, float]:
        return {name: get() - self.before[name] for name, get in self.read.items()}


def test_executed_replayed_and_mismatch_by_operation(api: APIClient, key: str) -> None:
    delta = Delta(
        {
            "executed": lambda: outcome("executed"),
            "replayed": lambda: outcome("replayed"),
            "mismatch": lambda: outcome("mismatch"),
            "claimed": lambda: claims("claimed"),
            "replay claims": lambda: claims("replayed"),
        }
    )
    post(api, "/charges/", {"amount": 1}, key)
    post(api, "/charges/", {"amount": 1}, key)
    post(api, "/charges/", {"amount": 2}, key)
    assert delta() == {
        "executed": 1,
        "replayed": 1,
        "mismatch": 1,
        "claimed": 1,
        "replay claims": 1,
    }


def test_counts_after_the_metrics_are_cleared_reach_the_registry(api: APIClient, key: str) -> None:
    """The counters read a child once made straight from the metric's table:
    one that ``clear()`` or ``remove()`` dropped must be made again, never
    counted into where no scrape reads it."""
    from idempotency_app.integrations.metrics import CLAIM_SECONDS, OUTCOMES

    post(api, "/charges/", {"amount": 1}, key)
    OUTCOMES.clear()
    CLAIM_SECONDS.clear()
    post(api, "/charges/", {"amount": 1}, key)
    assert (outcome("replayed"), claims("replayed")) == (1, 1)
    OUTCOMES.remove("replayed", OPERATION)
    CLAIM_SECONDS.remove("replayed")
    post(api, "/charges/", {"amount": 1}, key)
    assert (outcome("replayed"), claims("replayed")) == (1, 1)


def test_a_prometheus_client_without_the_table_of_children_still_counts(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child table is ``prometheus_client``'s private attribute: where a
    release has none, each count goes through ``labels()``."""
    from idempotency_app.integrations.metrics import OUTCOMES

    children = {("executed", OPERATION): Counter("executed", "", registry=CollectorRegistry())}
    monkeypatch.delattr(OUTCOMES, "_metrics")
    monkeypatch.setattr(OUTCOMES, "labels", lambda *values: children[values])
    post(api, "/charges/", {"amount": 1}, key)
    assert children[("executed", OPERATION)]._value.get() == 1


def test_the_retry_storm_guard(api: APIClient, key: str) -> None:
    delta = Delta({"guard": lambda: outcome("guard_hit"), "executed": lambda: outcome("executed")})
    for _ in range(3):
        assert post(api, "/charges/", {"raise": "validation"}, key).status_code == 400
    assert delta() == {"guard": 2, "executed": 1}


def test_conflict_and_takeover_from_the_service_api() -> None:
    operation = "tests.metrics"
    delta = Delta(
        {
            "conflict": lambda: outcome("conflict", operation),
            "takeover": lambda: outcome("takeover", operation),
        }
    )
    with clock.freeze():
        service.claim("metrics", "k1", operation, lease=5)
        with pytest.raises(service.KeyInProgress):
            service.claim("metrics", "k1", operation, lease=5)
        clock.advance(6)
        service.claim("metrics", "k1", operation, lease=5)
    assert delta() == {"conflict": 1, "takeover": 1}


@pytest.fixture
def broken_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise DatabaseError("the database refused the claim")

    monkeypatch.setattr(store.backend("default"), "claim", refuse)
    yield


def test_store_unavailable(api: APIClient, key: str, broken_store: None) -> None:
    delta = Delta(
        {"unavailable": lambda: outcome("store_unavailable"), "error": lambda: claims("error")}
    )
    assert post(api, "/charges/", {"amount": 1}, key).status_code == 503
    assert delta() == {"unavailable": 1, "error": 1}


def test_claim_latency_is_observed_in_seconds(api: APIClient, key: str) -> None:
    before = (
        REGISTRY.get_sample_value("idempotency_claim_seconds_sum", {"decision": "claimed"}) or 0
    )
    post(api, "/charges/", {"amount": 1}, key)
    spent = REGISTRY.get_sample_value("idempotency_claim_seconds_sum", {"decision": "claimed"})
    assert spent is not None and 0 < spent - before < 5


def test_timed_measures_only_while_someone_listens() -> None:
    signal = Signal()  # any Django signal, not only the library's
    calls: list[dict[str, Any]] = []

    @signals.timed(signal)
    def decide(identity: str, fail: bool = False) -> str:
        if fail:
            raise ValueError("no")
        return f"decided {identity}"

    assert decide("a") == "decided a"  # nobody listens: nothing sent

    def receiver(sender: Any, **kwargs: Any) -> None:
        calls.append(kwargs)

    signal.connect(receiver)
    assert decide("b") == "decided b"
    with pytest.raises(ValueError) as raised:
        decide("c", fail=True)
    assert [(c["identity"], c["decision"]) for c in calls] == [
        ("b", "decided b"),
        ("c", raised.value),
    ], "a claim that raised sends what it raised"
    assert all(0 <= c["seconds"] < 1 for c in calls)


def test_an_observer_hears_every_send_and_receivers_still_do() -> None:
    """The metrics observe a signal directly; a receiver connected the
    Django way, for any sender or for one, still gets what it did."""
    signal = signals.LibrarySignal()
    observed: list[Any] = []
    received: list[Any] = []
    only_claims: list[Any] = []

    @signals.timed(signal)
    def decide(identity: str) -> str:
        return identity

    signal.observers.append(lambda sender, **kwargs: observed.append(kwargs["decision"]))
    decide("a")
    signal.connect(lambda sender, **kwargs: received.append(sender), weak=False)
    signal.connect(lambda sender, **kwargs: only_claims.append(sender), sender=Claim, weak=False)
    signal.send(Claim, identity="b", seconds=0.0, decision="b")
    signal.send(None, identity="c", seconds=0.0, decision="c")
    assert observed == ["a", "b", "c"]
    assert received == [Claim, None] and only_claims == [Claim]


IDENTITY = Identity("metrics", "k", "POST sent-by-the-project/", "f")


def sent_by_the_project(name: str) -> float:
    return outcome(name, IDENTITY.operation)


def test_every_way_of_sending_is_counted() -> None:
    """A project may send the signals itself, robustly too; the counters
    hear it, and count as listeners."""
    before = sent_by_the_project("executed")
    signals.executed.send(None, identity=IDENTITY, status=201)
    signals.executed.send_robust(None, identity=IDENTITY, status=201)
    assert sent_by_the_project("executed") - before == 2
    assert signals.executed.has_listeners()


@pytest.mark.skipif(not hasattr(Signal, "asend"), reason="Signal.asend is Django 5.0's")
def test_asend_is_counted_too() -> None:
    before = sent_by_the_project("replayed")
    async_to_sync(signals.replayed.asend)(None, identity=IDENTITY)
    async_to_sync(signals.replayed.asend_robust)(None, identity=IDENTITY)
    assert sent_by_the_project("replayed") - before == 2


def test_a_failing_observer_does_not_stop_a_robust_send(caplog: pytest.LogCaptureFixture) -> None:
    received: list[Any] = []

    def fails(**kwargs: Any) -> None:
        raise RuntimeError("observer down")

    signal = signals.LibrarySignal()
    signal.observers.append(fails)
    signal.connect(lambda sender, **kwargs: received.append(sender), weak=False)
    signal.send_robust(Claim, identity=IDENTITY)
    assert received == [Claim]
    assert "observer down" in caplog.text
    with pytest.raises(RuntimeError):
        signal.send(Claim, identity=IDENTITY)


def scrape(client: APIClient) -> dict[tuple[str, str], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.content.decode()):
        if family.name == "idempotency_outcomes":
            for sample in family.samples:
                if sample.name == "idempotency_outcomes_total":
                    values[(sample.labels["outcome"], sample.labels["operation"])] = sample.value
    return values


@override_settings(ROOT_URLCONF="example_project.urls")
def test_the_example_project_serves_them_at_metrics(api: APIClient, user: Any, key: str) -> None:
    from example_project.payments.models import Account

    account = Account.objects.create(owner=user, name="main", balance=1000)
    operation = "POST api/accounts/<int:account_id>/charges/"
    before = scrape(api)
    url = f"/api/accounts/{account.pk}/charges/"
    post(api, url, {"amount": 10}, key)
    post(api, url, {"amount": 10}, key)
    after = scrape(api)
    for name in ("executed", "replayed"):
        assert after[(name, operation)] - before.get((name, operation), 0) == 1
