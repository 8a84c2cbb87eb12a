"""Settings of the bench project: PostgreSQL or MariaDB + Redis, nothing else in the way.

No middleware, no sessions, JSON only, and an authentication that is a
dictionary lookup, so the floor view measures Django + DRF and not a
password hash. Persistent database connections, as in production.

IDEMPOTENCY_BENCH_DB         postgres (default) | mysql (MariaDB or MySQL)
IDEMPOTENCY_BENCH_DB_HOST / _PORT / _USER / _PASSWORD / _NAME
                             default 127.0.0.1, 5432 or 3306, postgres or root,
                             no password, bench
IDEMPOTENCY_BENCH_REDIS_URL  default redis://127.0.0.1:6379/0
IDEMPOTENCY_BENCH_PREPARED   1: PostgreSQL with server-side binding and
                             prepared statements (psycopg prepares a
                             statement after 5 runs), for every view alike
"""

from __future__ import annotations

import os
from typing import Any

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
ROOT_URLCONF = "benchmarks.benchproject.urls"
WSGI_APPLICATION = "benchmarks.benchproject.wsgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "idempotency_app",
    "benchmarks.benchproject",
]
MIDDLEWARE: list[str] = []

# Where the large tables live (micro.py's claim figures, large_table.py):
# a schema of the bench database on PostgreSQL, a database of its own on
# MariaDB, so that nothing else there is disturbed.
LARGE = "bench_large"
BENCH_DB = os.environ.get("IDEMPOTENCY_BENCH_DB", "postgres").lower()
BENCH_NAME = os.environ.get("IDEMPOTENCY_BENCH_DB_NAME", "bench")
_mysql = BENCH_DB in ("mysql", "mariadb")
if not _mysql and BENCH_DB not in ("postgres", "postgresql"):
    raise RuntimeError(f"IDEMPOTENCY_BENCH_DB={BENCH_DB!r}: use postgres or mysql.")
_default: dict[str, Any] = {
    "ENGINE": f"django.db.backends.{'mysql' if _mysql else 'postgresql'}",
    "HOST": os.environ.get("IDEMPOTENCY_BENCH_DB_HOST", "127.0.0.1"),
    "PORT": os.environ.get("IDEMPOTENCY_BENCH_DB_PORT", "3306" if _mysql else "5432"),
    "USER": os.environ.get("IDEMPOTENCY_BENCH_DB_USER", "root" if _mysql else "postgres"),
    "PASSWORD": os.environ.get("IDEMPOTENCY_BENCH_DB_PASSWORD", ""),
    "NAME": BENCH_NAME,
    "CONN_MAX_AGE": None,
    "OPTIONS": {"charset": "utf8mb4"} if _mysql else {},
}
if not _mysql and os.environ.get("IDEMPOTENCY_BENCH_PREPARED") == "1":
    _default["OPTIONS"] = {"server_side_binding": True, "prepare_threshold": 5}
DATABASES = {
    "default": _default,
    "large": {
        **_default,
        **({"NAME": LARGE} if _mysql else {"OPTIONS": {"options": f"-c search_path={LARGE}"}}),
    },
}
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ.get("IDEMPOTENCY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
        "KEY_PREFIX": "idempotency-bench",
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.2, "SOCKET_TIMEOUT": 0.2},
    },
    # micro.py: the retry-storm guard without a network hop, for comparison.
    "local": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["benchmarks.benchproject.auth.TokenTableAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}

# Defaults, except a lease long enough for the conflict scenario's slow request.
IDEMPOTENCY = {"LEASE": 120, "SCOPE": "benchmarks.benchproject.auth.scope"}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"idempotency_app": {"handlers": ["console"], "level": "WARNING"}},
}
