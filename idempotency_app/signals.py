"""Signals for dashboards and alerts; each is sent with ``identity``.

``replayed`` (a stored response was served), ``conflict`` (a duplicate found
the key in progress), ``mismatch`` (the key was reused for another request),
``takeover`` (a lapsed claim was taken over), ``interrupted`` (work ended
its own transaction part-way: its key answers ``request_outcome_unknown``
until released, worth an alert), ``guard_hit`` (a cached
validation error was served), ``executed`` (a view ran under a claim;
also sent with ``status``, its response status) and ``store_unavailable``
(the database could not arbitrate a claim: the client gets 503).

``claim_timed`` is sent after every claim with ``seconds`` (how long it
took) and ``decision`` (what it decided: a ``lifecycle.claims.Claim`` or
``Replay``, or the exception it raised: ``KeyInProgress``, ``KeyReused``,
``OutcomeUnknown``, ``StoreUnavailable``). It is measured only while a
receiver is connected.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from django.dispatch import Signal

replayed = Signal()
conflict = Signal()
mismatch = Signal()
takeover = Signal()
interrupted = Signal()
guard_hit = Signal()
executed = Signal()
store_unavailable = Signal()
claim_timed = Signal()

P = ParamSpec("P")
R = TypeVar("R")


def timed(
    signal: Signal,
) -> Callable[[Callable[Concatenate[Any, P], R]], Callable[Concatenate[Any, P], R]]:
    """Send ``signal`` with the identity (the first argument), ``seconds``
    and ``decision`` (the result, None when it raised) after each call.
    Without receivers the cost is one attribute read."""

    def decorate(func: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
        @functools.wraps(func)
        def wrapper(identity: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if not signal.receivers:
                return func(identity, *args, **kwargs)
            decision: Any = None
            started = time.perf_counter()
            try:
                decision = func(identity, *args, **kwargs)
                return decision  # type: ignore[no-any-return]
            except BaseException as exc:
                decision = exc
                raise
            finally:
                seconds = time.perf_counter() - started
                signal.send(func, identity=identity, seconds=seconds, decision=decision)

        return wrapper

    return decorate
