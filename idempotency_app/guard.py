"""The retry-storm guard: validation errors cached for a few seconds.

A 400 releases its claim, so without a guard every retry of a bad request
runs the view again. The guard serves the cached 400 instead, keyed by the
same identity the record compares (scope, key, operation, and a fingerprint
that includes the body's content type), so a corrected request, or one to
another endpoint, is never answered from it.

Fail-open: a cache error never fails a request. After one, the guard is
skipped for ``CACHE_RETRY_INTERVAL`` seconds, which both bounds what a dead
cache adds to latency (one socket timeout per interval per process) and
rate-limits the warning.

Values are a small versioned JSON document, never a pickle: with
django-redis the raw client stores our bytes as they are.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from typing import Any

from django.core.cache import caches

from idempotency_app.conf import conf
from idempotency_app.store import Identity, StoredResponse

logger = logging.getLogger("idempotency_app")

VALUE_VERSION = 1
_down_until = 0.0


class TransientErrorCache:
    """Swappable in tests: ``cache`` and ``timer`` are attributes, and
    ``get_cache_key()`` is the one place the key is made."""

    timer = staticmethod(time.monotonic)

    @property
    def cache(self) -> Any:
        return caches[conf.CACHE_ALIAS]

    def get_cache_key(self, identity: Identity) -> str:
        raw = "\x1f".join((identity.scope, identity.key, identity.operation, identity.fingerprint))
        return (
            "idempotency:transient:"
            + hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()
        )

    def get(self, identity: Identity) -> StoredResponse | None:
        if conf.TRANSIENT_ERROR_TTL <= 0 or not self._available():
            return None
        try:
            raw = self._raw_get(self.get_cache_key(identity))
        except Exception as exc:
            self._mark_down(exc)
            return None
        return None if raw is None else decode(raw)

    def set(self, identity: Identity, response: StoredResponse) -> None:
        ttl = conf.TRANSIENT_ERROR_TTL
        if ttl <= 0 or not self._available():
            return
        try:
            self._raw_set(self.get_cache_key(identity), encode(response), ttl)
        except Exception as exc:
            self._mark_down(exc)

    def _raw_get(self, key: str) -> bytes | str | None:
        cache = self.cache
        client = _redis_client(cache)
        if client is not None:
            value: bytes | None = client.get(cache.make_key(key))
            return value
        result: str | None = cache.get(key)
        return result

    def _raw_set(self, key: str, value: str, ttl: float) -> None:
        cache = self.cache
        client = _redis_client(cache)
        if client is not None:
            client.set(cache.make_key(key), value.encode(), px=max(1, int(ttl * 1000)))
        else:
            cache.set(key, value, ttl)

    def _available(self) -> bool:
        return self.timer() >= _down_until

    def _mark_down(self, exc: Exception) -> None:
        global _down_until
        _down_until = self.timer() + conf.CACHE_RETRY_INTERVAL
        logger.warning(
            "Idempotency cache %r unavailable (%s); the retry-storm guard is off for %ss",
            conf.CACHE_ALIAS,
            exc,
            conf.CACHE_RETRY_INTERVAL,
        )


def _redis_client(cache: Any) -> Any:
    """The raw redis client behind a django-redis cache, if that is what it is."""
    client = getattr(cache, "client", None)
    get_client = getattr(client, "get_client", None)
    return get_client(write=True) if get_client is not None else None


def encode(response: StoredResponse) -> str:
    """``"b": null`` keeps an omitted (oversized) body distinct from an empty one."""
    body = None if response.body is None else base64.b64encode(response.body).decode()
    return json.dumps(
        {"v": VALUE_VERSION, "s": response.status, "h": response.headers, "b": body},
        separators=(",", ":"),
    )


def decode(raw: bytes | str) -> StoredResponse | None:
    """None for anything we did not write (another version, garbage)."""
    try:
        data = json.loads(raw)
        if data.get("v") != VALUE_VERSION:
            return None
        headers = tuple((str(n), str(v)) for n, v in data["h"])
        body = None if data["b"] is None else base64.b64decode(data["b"])
        return StoredResponse(int(data["s"]), headers, body)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


guard = TransientErrorCache()
