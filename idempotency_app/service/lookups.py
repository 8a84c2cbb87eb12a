"""Reading what is stored, one key or a thousand per query: advice for
skipping work cheaply, never the arbiter (the claim is)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from idempotency_app import clock, store
from idempotency_app.conf import conf
from idempotency_app.http import keys
from idempotency_app.models import IdempotencyRecord
from idempotency_app.service.results import decode
from idempotency_app.store import StoredResponse

# One IN (...) list per this many keys: well under every backend's limit
# on query parameters.
LOOKUP_BATCH = 1000


@dataclass(frozen=True)
class Entry:
    """A live record as one query saw it. Expired records are not entries."""

    key: str
    operation: str
    status: str
    expires_at: datetime
    locked_until: datetime | None
    response_status: int | None = field(repr=False)
    body: bytes | None = field(repr=False)
    headers: str = field(repr=False)

    @property
    def completed(self) -> bool:
        return self.status == store.COMPLETED

    @property
    def interrupted(self) -> bool:
        """Its work ended its own transaction part-way: a claim raises
        ``OutcomeUnknown`` until an operator releases the key."""
        return self.status == store.INTERRUPTED

    @property
    def result(self) -> Any:
        """The stored result; None while the work is in progress."""
        if not self.completed:
            return None
        headers = store.parse_headers(self.headers)
        return decode(StoredResponse(self.response_status, headers, self.body))


def lookup(scope: str, key: str | int) -> Entry | None:
    key = str(key)
    return lookup_many(scope, [key]).get(key)


def lookup_many(scope: str, keys_: Iterable[str | int]) -> dict[str, Entry]:
    """The live records for ``keys_`` in ``scope``, by key, in one query
    (one per 1000 keys). A key with no entry has never run, or expired, or
    was released: claim it. Reading is advice; the claim stays the arbiter.
    An interrupted entry's outcome is unknown: claiming it raises
    ``OutcomeUnknown``.
    """
    wanted = sorted({str(k) for k in keys_})
    found: dict[str, Entry] = {}
    records = IdempotencyRecord.objects.using(conf.DATABASE_ALIAS)
    now = clock.DatabaseNow()
    for start in range(0, len(wanted), LOOKUP_BATCH):
        rows = records.filter(
            scope=keys.bounded(scope),
            key__in=wanted[start : start + LOOKUP_BATCH],
            expires_at__gt=now,
            status__in=(store.IN_PROGRESS, store.COMPLETED, store.INTERRUPTED),
        ).values_list(
            "key",
            "operation",
            "status",
            "expires_at",
            "locked_until",
            "response_status",
            "response_body",
            "response_headers",
        )
        for key, operation, status, expires_at, locked_until, code, body, headers in rows:
            raw = None if body is None else bytes(body)
            found[key] = Entry(key, operation, status, expires_at, locked_until, code, raw, headers)
    return found
