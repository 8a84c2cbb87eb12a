"""A readiness probe for health endpoints: is the records table reachable,
does the cache answer? Each problem is said in plain words, safe for a 503
body that anyone can read: the error itself, whose text can name hosts,
ports and database roles, goes only to the ``idempotency_app`` log.

A cache that is down does not fail requests (the retry-storm guard is
fail-open), but it is still reported: the guard is off until it is back.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from django.core.cache import caches
from django.db import transaction

from idempotency_app.conf import conf
from idempotency_app.models import IdempotencyRecord

logger = logging.getLogger("idempotency_app")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    problems: list[str] = field(default_factory=list)


def probe() -> ProbeResult:
    problems = [p for p in (_check_table(), _check_cache()) if p]
    return ProbeResult(ok=not problems, problems=problems)


def _check_table() -> str | None:
    using = conf.DATABASE_ALIAS
    try:
        # A savepoint, so a failure cannot poison a caller's transaction.
        with transaction.atomic(using=using):
            IdempotencyRecord.objects.using(using).exists()
    except Exception as exc:  # a probe reports; it never raises
        logger.error(
            "Probe: the idempotency table cannot be read on database %r: %s: %s",
            using,
            exc.__class__.__name__,
            exc,
        )
        return (
            f"The idempotency table cannot be read on database {using!r}. "
            "Check that the database is reachable and that migrations ran; "
            "the error is in the idempotency_app log."
        )
    return None


def _check_cache() -> str | None:
    alias = conf.CACHE_ALIAS
    key = f"idempotency:probe:{secrets.token_hex(8)}"
    value = secrets.token_hex(8)
    try:
        cache = caches[alias]
        cache.set(key, value, 10)
        answer = cache.get(key)
        cache.delete(key)
    except Exception as exc:  # a probe reports; it never raises
        logger.warning(
            "Probe: the cache %r does not answer: %s: %s", alias, exc.__class__.__name__, exc
        )
        return (
            f"The cache {alias!r} does not answer. Requests still succeed, but a retried "
            "validation error runs the view again until the cache is back. Check that the "
            "cache server is reachable; the error is in the idempotency_app log."
        )
    if answer != value:
        return (
            f"The cache {alias!r} did not return a value just written to it "
            "(a dummy cache, or errors ignored by its settings): the retry-storm guard cannot work."
        )
    return None
