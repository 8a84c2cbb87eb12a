"""Where records live: one backend per database vendor, as Django's own
backends are, behind the small interface of ``base.Backend``.

``backend(using)`` gives the alias's backend (built once per process); the
lifecycle asks it to claim, complete, release, interrupt and renew, each in
one statement, and the sweep and the admin to delete in bounded batches.
"""

from __future__ import annotations

import functools

from django.db import connections

from idempotency_app.store import mysql, postgresql, sqlite
from idempotency_app.store.base import (
    CLAIMED,
    COMPLETED,
    IN_PROGRESS,
    INTERRUPTED,
    RELEASED,
    Backend,
    Claimed,
    Existing,
    Identity,
    StoredResponse,
    parse_headers,
)

__all__ = [
    "CLAIMED",
    "COMPLETED",
    "INTERRUPTED",
    "IN_PROGRESS",
    "RELEASED",
    "Backend",
    "Claimed",
    "Existing",
    "Identity",
    "StoredResponse",
    "backend",
    "parse_headers",
]

BACKENDS: dict[str, type[Backend]] = {
    "postgresql": postgresql.Backend,
    "mysql": mysql.Backend,
    "sqlite": sqlite.Backend,
}


@functools.cache
def backend(using: str) -> Backend:
    """The store of database alias ``using``."""
    return BACKENDS[connections[using].vendor](using)
