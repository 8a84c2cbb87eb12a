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
``OutcomeUnknown``, ``StoreUnavailable``). It is measured only while
someone listens: a receiver, or the library's metrics.

Each is a ``LibrarySignal``: a Django ``Signal`` whose receivers are
connected and called as usual, and which first calls the library's own
observers (the Prometheus counters) directly.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from django.dispatch import Signal

logger = logging.getLogger("idempotency_app")


class LibrarySignal(Signal):
    """A Django signal that also calls the library's own observers (its
    metrics) directly, before the receivers: they hear every request, and
    Django's dispatch costs several times the counter each one updates.
    Receivers connected with ``connect()`` get every send as from any
    ``Signal``; observers hear every way of sending (``send_robust`` and,
    on Django 5, ``asend`` too) and count as listeners."""

    def __init__(self) -> None:
        super().__init__()
        # Called with every send's sender and arguments, in order.
        self.observers: list[Callable[..., None]] = []

    def send(self, sender: Any, **named: Any) -> list[tuple[Any, Any]]:
        for observer in self.observers:
            observer(sender=sender, **named)
        if not self.receivers:
            return []
        return super().send(sender, **named)

    def send_robust(self, sender: Any, **named: Any) -> list[tuple[Any, Any]]:
        self._observe_robustly(sender, named)
        return super().send_robust(sender, **named)

    if hasattr(Signal, "asend"):  # Django 5.0 and later

        async def asend(self, sender: Any, **named: Any) -> list[tuple[Any, Any]]:
            for observer in self.observers:  # in-process counters: nothing to await
                observer(sender=sender, **named)
            return await super().asend(sender, **named)  # type: ignore[misc, no-any-return, unused-ignore]

        async def asend_robust(self, sender: Any, **named: Any) -> list[tuple[Any, Any]]:
            self._observe_robustly(sender, named)
            return await super().asend_robust(sender, **named)  # type: ignore[misc, no-any-return, unused-ignore]

    def has_listeners(self, sender: Any = None) -> bool:
        return bool(self.observers) or super().has_listeners(sender)

    def _observe_robustly(self, sender: Any, named: dict[str, Any]) -> None:
        for observer in self.observers:
            try:
                observer(sender=sender, **named)
            except Exception:
                logger.exception("Observer %r of an idempotency signal failed", observer)


replayed = LibrarySignal()
conflict = LibrarySignal()
mismatch = LibrarySignal()
takeover = LibrarySignal()
interrupted = LibrarySignal()
guard_hit = LibrarySignal()
executed = LibrarySignal()
store_unavailable = LibrarySignal()
claim_timed = LibrarySignal()

P = ParamSpec("P")
R = TypeVar("R")


def timed(
    signal: Signal,
) -> Callable[[Callable[Concatenate[Any, P], R]], Callable[Concatenate[Any, P], R]]:
    """Send ``signal`` with the identity (the first argument), ``seconds``
    and ``decision`` (the result, or the exception it raised) after each
    call. Heard by nobody, the cost is two attribute reads."""

    def decorate(func: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
        observers = getattr(signal, "observers", ())  # a LibrarySignal's, or none

        @functools.wraps(func)
        def wrapper(identity: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if not signal.receivers and not observers:
                return func(identity, *args, **kwargs)
            started = time.perf_counter()
            try:
                decision = func(identity, *args, **kwargs)
            except BaseException as exc:
                # Named only in the handler, which forgets it: a local of this
                # frame, which the exception's traceback holds, would be a
                # reference cycle left for the garbage collector.
                seconds = time.perf_counter() - started
                signal.send(func, identity=identity, seconds=seconds, decision=exc)
                raise
            seconds = time.perf_counter() - started
            signal.send(func, identity=identity, seconds=seconds, decision=decision)
            return decision

        return wrapper

    return decorate
