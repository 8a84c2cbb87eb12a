"""The bench settings with drf-idempotency 1.0 in place of our library.

Only ``peers.py``'s peer server runs these. Both libraries read the
``IDEMPOTENCY`` setting, so ours is not installed here (its checks and
request receivers stay out of the peer's figures) and the peer's app is
installed nowhere else. The peer keeps its records in Redis, under a prefix
of their own that ``peers.py`` empties; its model's table is never used
(the Redis backend does not touch it), so it is not migrated.
"""

from __future__ import annotations

from benchmarks.benchproject.settings import *  # noqa: F403
from benchmarks.benchproject.settings import CACHES, INSTALLED_APPS

INSTALLED_APPS = [app for app in INSTALLED_APPS if app != "idempotency_app"] + ["drf_idempotency"]
ROOT_URLCONF = "benchmarks.benchproject.peer_urls"
MIDDLEWARE = [
    "drf_idempotency.middleware.IdempotencyMiddleware"
]  # why not the decorator: peer_urls
PEER_REDIS_PREFIX = "idempotency-bench-peer:"
IDEMPOTENCY = {
    "BACKEND": "drf_idempotency.backends.redis.RedisBackend",
    "BACKEND_OPTIONS": {"url": CACHES["default"]["LOCATION"], "key_prefix": PEER_REDIS_PREFIX},
    "TTL_SECONDS": 3600,
}
