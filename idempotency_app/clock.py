"""The one source of time for leases and expiry, so tests can move it.

``freeze(at)`` pins it; ``advance(seconds)`` moves a frozen clock forward.
Production code calls ``now()`` and never ``timezone.now()`` directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime, timedelta

from django.utils import timezone

_frozen: datetime | None = None


def now() -> datetime:
    return _frozen if _frozen is not None else timezone.now()


@contextlib.contextmanager
def freeze(at: datetime | None = None) -> Iterator[None]:
    global _frozen
    previous = _frozen
    _frozen = at or timezone.now()
    try:
        yield
    finally:
        _frozen = previous


def advance(seconds: float) -> None:
    global _frozen
    if _frozen is None:
        raise RuntimeError("advance() needs a frozen clock: use clock.freeze() first.")
    _frozen += timedelta(seconds=seconds)
