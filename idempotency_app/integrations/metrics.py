"""Prometheus metrics, built on the library's signals.

Registered in ``prometheus_client``'s default registry, the one that
django-prometheus's ``/metrics`` view, ``prometheus_client``'s own exporters
and its multiprocess collector all read: a project that already exports
metrics gets these with no configuration. Imported by
``IdempotencyConfig.ready()`` when ``prometheus_client`` is installed
(the ``metrics`` extra).

- ``idempotency_outcomes_total{outcome, operation}``: ``executed``,
  ``replayed``, ``conflict``, ``mismatch``, ``takeover``, ``interrupted``
  (alert on it: a key that answers ``request_outcome_unknown``), ``guard_hit`` and
  ``store_unavailable``. The operation is the method and route pattern
  (``POST api/accounts/<int:account_id>/charges/``), so the label's values
  are as few as the routes; keys and scopes are never labels.
- ``idempotency_claim_seconds{decision}``: how long a claim took to decide
  ``claimed``, ``replayed``, ``conflict``, ``mismatch`` or ``interrupted``
  (``error`` when the database failed). A claim that waited for an in-flight duplicate
  (``WAIT_FOR_IN_FLIGHT``) includes the wait.

The receivers only touch in-process counters: no I/O, no database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Histogram

from idempotency_app import signals
from idempotency_app.exceptions import KeyInProgress, KeyReused, OutcomeUnknown
from idempotency_app.lifecycle.claims import Claim, Replay

OUTCOMES = Counter(
    "idempotency_outcomes",
    "Idempotent requests and tasks by what happened to them.",
    ["outcome", "operation"],
)
CLAIM_SECONDS = Histogram(
    "idempotency_claim_seconds",
    "Time to claim an idempotency key, by what the claim decided.",
    ["decision"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
COUNTED: dict[str, signals.LibrarySignal] = {
    "executed": signals.executed,
    "replayed": signals.replayed,
    "conflict": signals.conflict,
    "mismatch": signals.mismatch,
    "takeover": signals.takeover,
    "interrupted": signals.interrupted,
    "guard_hit": signals.guard_hit,
    "store_unavailable": signals.store_unavailable,
}
# What a claim decided, as the histogram's label; anything else is "error".
DECISIONS: tuple[tuple[type, str], ...] = (
    (Claim, "claimed"),
    (Replay, "replayed"),
    (KeyInProgress, "conflict"),
    (KeyReused, "mismatch"),
    (OutcomeUnknown, "interrupted"),
)


def _child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)`` for labels that are plain strings (what
    ``labels()`` makes of anything else is its ``str()``, which a subclass of
    ``str`` may spell otherwise): the child read straight from the metric's
    own table once made (a dict read, atomic under the GIL), where
    ``labels()`` checks, converts and locks on every call. A child that
    ``clear()`` or ``remove()`` dropped is gone from that table, so
    ``labels()`` makes it again: nothing is counted into an orphan. The
    table is ``prometheus_client``'s own attribute; without it, ``labels()``."""
    table = getattr(metric, "_metrics", None)
    child = table.get(labels) if table is not None else None
    return child if child is not None else metric.labels(*labels)


def _counter(outcome: str) -> Callable[..., None]:
    def count(sender: Any, identity: Any, **kwargs: Any) -> None:
        operation = identity.operation
        if type(operation) is not str:  # labelled by str(), as labels() would (an enum's name)
            operation = str(operation)
        _child(OUTCOMES, outcome, operation).inc()

    return count


def observe_claim(sender: Any, seconds: float, decision: Any = None, **kwargs: Any) -> None:
    kind = type(decision)
    label = _LABELS.get(kind)
    if label is None:
        label = _LABELS[kind] = next(
            (name for base, name in DECISIONS if issubclass(kind, base)), "error"
        )
    _child(CLAIM_SECONDS, label).observe(seconds)


# The histogram's label by the decision's type, found once per type (a
# handful: the claims, the replay and the errors a claim raises).
_LABELS: dict[type, str] = {}


# Observers, not receivers: called directly on every send (see LibrarySignal).
for _outcome, _signal in COUNTED.items():
    _signal.observers.append(_counter(_outcome))
signals.claim_timed.observers.append(observe_claim)
