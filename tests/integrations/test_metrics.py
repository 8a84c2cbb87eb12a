"""Prometheus metrics from the signals: counters by outcome and operation,
the claim histogram, and the example project's /metrics."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import textwrap
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
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


class Op(str, enum.Enum):
    """A common way to name operations: ``str()`` of a member is
    ``Op.PAYOUT``; its value and hash are its value's."""

    PAYOUT = "metrics-payout"


def run_once(operation: str) -> None:
    with service.once("review6", str(uuid.uuid4()), operation) as run:
        if run.should_execute:
            run.result = {"ok": 1}


def test_an_enum_operation_is_counted_under_one_label_whatever_was_counted_before() -> None:
    """``labels()`` labels an enum operation by ``str()`` (``Op.PAYOUT``);
    the child table is keyed by that string, but the lookup uses the raw
    member, which equals (and hashes as) its value. Once a plain
    ``"metrics-payout"`` child exists, the enum's counts go to it instead:
    the same operation's executions split across two series depending on
    what ran first."""
    label = str(Op.PAYOUT)
    run_once(Op.PAYOUT)
    assert outcome("executed", label) == 1
    run_once(Op.PAYOUT.value)  # a plain string with the same text makes its own child
    assert outcome("executed", Op.PAYOUT.value) == 1
    run_once(Op.PAYOUT)  # the same enum operation again
    assert (outcome("executed", label), outcome("executed", Op.PAYOUT.value)) == (2, 1)


class Unhashable(str):
    """A str subclass that defines ``__eq__`` (and so has no ``__hash__``):
    accepted as an operation (``isinstance(operation, str)``), stored by its
    value; ``labels()`` takes ``str()`` of it."""

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]


def test_an_operation_that_is_an_unhashable_str_subclass_is_counted_not_raised() -> None:
    """Accepted as an operation (a ``str``): counted under its text, never
    a TypeError out of the ``executed`` observer after the work committed."""
    name = Unhashable("metrics-unhashable")
    run_once(name)
    assert outcome("executed", "metrics-unhashable") == 1


def test_threads_counting_while_others_clear_never_raise() -> None:
    """Counting races clear() and remove() (a dict replaced or shrunk under
    the lookup): no exception reaches the caller, and counts made once the
    clearing stopped all reach the registry."""
    from idempotency_app.integrations.metrics import OUTCOMES, _counter

    count = _counter("executed")

    class Ident:
        operation = "metrics-threads"

    stop = threading.Event()
    errors: list[BaseException] = []

    def clearer() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while not stop.is_set():
                OUTCOMES.clear()
                OUTCOMES.remove("executed", "metrics-threads")

    def counter() -> None:
        try:
            for _ in range(5000):
                count(None, Ident())
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=clearer)] + [
        threading.Thread(target=counter) for _ in range(4)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads[1:]:
            thread.join()
    finally:
        stop.set()
        threads[0].join()
        sys.setswitchinterval(interval)
    assert errors == []
    OUTCOMES.clear()
    for _ in range(100):
        count(None, Ident())
    assert outcome("executed", "metrics-threads") == 100


def test_label_values_of_other_types_are_counted_by_their_text() -> None:
    from idempotency_app.integrations.metrics import _counter

    class Ident:
        operation: Any = 7

    _counter("executed")(None, Ident())
    _counter("executed")(None, Ident())
    assert outcome("executed", "7") == 2


MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import warnings
    import django
    django.setup()
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector
    from idempotency_app.integrations.metrics import CLAIM_SECONDS, OUTCOMES, _counter, observe_claim
    from idempotency_app.lifecycle.claims import Replay

    class Ident:
        operation = "POST metrics/"

    count = _counter("replayed")
    warnings.simplefilter("ignore")
    for _ in range(3):
        count(None, Ident())
        observe_claim(None, 0.001, Replay(None))
    OUTCOMES.clear()
    CLAIM_SECONDS.clear()
    for _ in range(2):
        count(None, Ident())
        observe_claim(None, 0.001, Replay(None))
    OUTCOMES.remove("replayed", "POST metrics/")
    count(None, Ident())
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    print(registry.get_sample_value(
        "idempotency_outcomes_total", {"outcome": "replayed", "operation": "POST metrics/"}
    ))
    print(registry.get_sample_value("idempotency_claim_seconds_count", {"decision": "replayed"}))
    """
)


def test_multiprocess_counts_across_clear_and_remove(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    out = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # In multiprocess mode a child made again after clear() reads the same
    # file: every count is kept.
    assert out.stdout.split() == ["6.0", "5.0"]
