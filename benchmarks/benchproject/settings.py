"""Settings of the bench project: PostgreSQL + Redis, nothing else in the way.

No middleware, no sessions, JSON only, and an authentication that is a
dictionary lookup, so the floor view measures Django + DRF and not a
password hash. Persistent database connections, as in production.

IDEMPOTENCY_BENCH_DB_HOST / _PORT / _USER / _PASSWORD / _NAME (default bench)
IDEMPOTENCY_BENCH_REDIS_URL  default redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import os

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

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": os.environ.get("IDEMPOTENCY_BENCH_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("IDEMPOTENCY_BENCH_DB_PORT", "5432"),
        "USER": os.environ.get("IDEMPOTENCY_BENCH_DB_USER", "postgres"),
        "PASSWORD": os.environ.get("IDEMPOTENCY_BENCH_DB_PASSWORD", ""),
        "NAME": os.environ.get("IDEMPOTENCY_BENCH_DB_NAME", "bench"),
        "CONN_MAX_AGE": None,
    }
}
# The same database seen through a second schema: micro.py keeps a large
# table there and alternates claims between the two sizes.
DATABASES["large"] = {
    **DATABASES["default"],
    "OPTIONS": {"options": "-c search_path=bench_large"},
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
IDEMPOTENCY = {"LEASE": 120}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"idempotency_app": {"handlers": ["console"], "level": "WARNING"}},
}
