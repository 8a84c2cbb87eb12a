"""A small payments API that uses every feature of idempotency_app.

Runs on SQLite with the local-memory cache and no configuration. Name a
server with environment variables:

EXAMPLE_DB          sqlite (default) | postgres | mysql
EXAMPLE_DB_HOST     default 127.0.0.1; EXAMPLE_DB_NAME default "test";
                    EXAMPLE_DB_USER default postgres / root; EXAMPLE_DB_PASSWORD
EXAMPLE_REDIS_URL   e.g. redis://127.0.0.1:6379/1; unset = local-memory cache
EXAMPLE_SQLITE_PATH the SQLite file; default example.sqlite3 beside this file
EXAMPLE_ERROR_FORMAT  detail (default) | problem | handler (IDEMPOTENCY["ERROR_FORMAT"])

It also shows the consumer's side: an OpenAPI schema at /api/schema/
(drf-spectacular), CORS for a browser client on another origin
(django-cors-headers) and Prometheus metrics at /metrics (django-prometheus).
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import django
from corsheaders.defaults import default_headers

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = os.environ.get("EXAMPLE_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("EXAMPLE_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
ASGI_APPLICATION = "example_project.asgi.application"  # uvicorn example_project.asgi:application
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "corsheaders",
    "django_prometheus",
    "idempotency_app",
    "example_project.payments",
]
# The webhook enqueues a receipt task (payments/tasks.py) with django.tasks.
# With django-tasks-db the task is a row in this database, run by
# `python manage.py db_worker`; without it, the task runs as it is enqueued.
if find_spec("django_tasks_db") is not None and (
    django.VERSION >= (6, 0) or find_spec("django_tasks") is not None
):
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
else:
    _tasks = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
    TASKS = {"default": {"BACKEND": f"{_tasks}.backends.immediate.ImmediateBackend"}}
MIDDLEWARE = [
    "corsheaders.middleware.CorsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

_db = os.environ.get("EXAMPLE_DB", "sqlite").lower()
_server = {
    "HOST": os.environ.get("EXAMPLE_DB_HOST", "127.0.0.1"),
    "NAME": os.environ.get("EXAMPLE_DB_NAME", "test"),
    "PASSWORD": os.environ.get("EXAMPLE_DB_PASSWORD", ""),
}
if _db in ("postgres", "postgresql"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "USER": os.environ.get("EXAMPLE_DB_USER", "postgres"),
            **_server,
        }
    }
elif _db in ("mysql", "mariadb"):
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "USER": os.environ.get("EXAMPLE_DB_USER", "root"),
            "OPTIONS": {"charset": "utf8mb4"},
            **_server,
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("EXAMPLE_SQLITE_PATH", BASE_DIR / "example.sqlite3"),
            # Writers queue instead of failing with "database is locked" when a
            # duplicate's claim lands while a request's transaction runs.
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20}
            if django.VERSION >= (5, 1)
            else {},
        }
    }

if os.environ.get("EXAMPLE_REDIS_URL"):
    CACHES = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": os.environ["EXAMPLE_REDIS_URL"],
            # A dead Redis costs at most these timeouts, once per
            # CACHE_RETRY_INTERVAL per process; requests still succeed.
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.1, "SOCKET_TIMEOUT": 0.1},
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.BasicAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # drf-spectacular's AutoSchema, plus the idempotency protocol on every
    # idempotent operation and the API's own errors.
    "DEFAULT_SCHEMA_CLASS": "example_project.payments.schema.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Example payments API",
    "DESCRIPTION": "Charges, refunds and accounts, safe to retry with an Idempotency-Key header.",
    "VERSION": "1.0.0",
    # Request bodies get their own components, with the constraints that
    # only apply to input (a name may not be blank).
    "COMPONENT_SPLIT_REQUEST": True,
}

# A browser client served from another origin (a single-page app on :5173,
# say) may send the key and read the protocol's headers; checks W008 and
# W009 say what is missing here.
CORS_ALLOWED_ORIGINS = ["http://localhost:5173", "http://127.0.0.1:5173"]
CORS_ALLOW_HEADERS = (*default_headers, "idempotency-key")
CORS_EXPOSE_HEADERS = ["Idempotent-Replayed", "Idempotency-Expires", "Retry-After", "Location"]

IDEMPOTENCY = {
    "TTL": 24 * 3600,
    "LEASE": 30,
    "TRANSIENT_ERROR_TTL": 10,
    # No cron needed for the example: a finished request sweeps expired keys
    # at most every 5 minutes (each round shows in the admin).
    "AUTO_SWEEP_INTERVAL": 300,
    # A retry within 2 s of the answer it repeats is served from this
    # process's memory, without a statement; the admin's expire empties it.
    "REPLAY_CACHE": 2,
    "ERROR_FORMAT": os.environ.get("EXAMPLE_ERROR_FORMAT", "detail"),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"idempotency_app": {"handlers": ["console"], "level": "INFO"}},
}
