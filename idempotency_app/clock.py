"""Time for leases and expiry is the database's: every decision is taken
inside a statement, against the database's clock, so app servers whose
clocks disagree never disagree about who holds a key.

``sql(vendor)`` is that clock as SQL: the database's current instant plus a
number of seconds given as the one parameter, for ``now + TTL`` and the like.
``DatabaseNow`` is the same for ORM queries.

``now()`` is the app server's estimate of the same instant, for what only
informs or schedules (the ``Idempotency-Expires`` header, the admin's date
links, when this process next tries an automatic sweep), never decides.

Tests move time: ``with freeze(): ... advance(61)`` makes a lease of 60 s
look lapsed (and empties ``REPLAY_CACHE``, which counts real seconds). Inside ``freeze(at)``, ``now()`` stands still at ``at`` (moved
only by ``advance``), and every statement adds the offset that makes the
database's clock read about ``at`` too; the database's clock itself keeps
running underneath, so decisions are exact to the test's own run time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from django.db.models import DateTimeField, Expression
from django.utils import timezone

_offset = 0.0
_frozen: datetime | None = None

# The database's instant plus {seconds} seconds (a query parameter). UTC on
# MySQL and SQLite whatever USE_TZ says: a local clock repeats or skips an hour
# at daylight-saving changes, which could lapse a live lease. PostgreSQL's
# timestamptz is absolute; statement_timestamp(), unlike now(), moves inside
# a transaction.
_SQL = {
    "postgresql": "(statement_timestamp() + {seconds} * interval '1 second')",
    "mysql": "(UTC_TIMESTAMP(6) + INTERVAL {seconds} MICROSECOND)",
    "sqlite": "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', {seconds})",
}


def offset() -> float:
    """Seconds the tests added to the database's clock; 0 in production."""
    return _offset


def sql(vendor: str, name: str | None = None) -> str:
    """The database's now plus the seconds of one parameter: positional
    (``%s``), or the named ``%(name)s``."""
    return _SQL[vendor].format(seconds="%s" if name is None else f"%({name})s")


def param(vendor: str, seconds: float) -> Any:
    """The parameter for ``sql(vendor)``: ``seconds`` from now, plus the offset."""
    total = _offset + seconds
    if vendor == "mysql":
        return round(total * 1_000_000)
    if vendor == "sqlite":
        return f"{total:+.6f} seconds"
    return total


def now() -> datetime:
    """The app server's estimate of the database's "now" (informative only)."""
    return _frozen if _frozen is not None else timezone.now()


class DatabaseNow(Expression):
    """The database's clock (plus ``seconds``) in an ORM query:
    ``filter(expires_at__lte=DatabaseNow())``."""

    output_field = DateTimeField()

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.seconds = seconds

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        vendor = connection.vendor
        return sql(vendor), (param(vendor, self.seconds),)


@contextlib.contextmanager
def freeze(at: datetime | None = None) -> Iterator[None]:
    """Stop ``now()`` at ``at`` (default: now) and shift the database's
    clock to match, until the block ends."""
    global _offset, _frozen
    previous = _offset, _frozen
    real = timezone.now()
    _frozen = at or real
    _offset = (_frozen - real).total_seconds()
    _forget_replays()
    try:
        yield
    finally:
        _offset, _frozen = previous
        _forget_replays()


def advance(seconds: float) -> None:
    global _offset, _frozen
    if _frozen is None:
        raise RuntimeError("advance() needs a frozen clock: use clock.freeze() first.")
    _offset += seconds
    _frozen += timedelta(seconds=seconds)
    _forget_replays()


def _forget_replays() -> None:
    """REPLAY_CACHE counts in real seconds: once the database's clock has
    moved, what a process holds may have expired there."""
    from idempotency_app.lifecycle import replays

    replays.clear()
