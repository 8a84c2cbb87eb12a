"""A small payments API that uses every feature of idempotency_app.

Runs on SQLite with the local-memory cache and no configuration. Name a
server with environment variables:

EXAMPLE_DB          sqlite (default) | postgres | mysql
EXAMPLE_DB_HOST     default 127.0.0.1; EXAMPLE_DB_NAME default "test";
                    EXAMPLE_DB_USER default postgres / root; EXAMPLE_DB_PASSWORD
EXAMPLE_REDIS_URL   e.g. redis://127.0.0.1:6379/1; unset = local-memory cache
"""

from __future__ import annotations

import os
from pathlib import Path

import django

BASE_DIR = Path(__file__).resolve().parent
SECRET_KEY = os.environ.get("EXAMPLE_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("EXAMPLE_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
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
    "idempotency_app",
    "example_project.payments",
]
MIDDLEWARE = [
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
            "NAME": BASE_DIR / "example.sqlite3",
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
}

IDEMPOTENCY = {
    "TTL": 24 * 3600,
    "LEASE": 30,
    "TRANSIENT_ERROR_TTL": 10,
    # No cron needed for the example: a finished request sweeps expired keys
    # at most every 5 minutes (each round shows in the admin).
    "AUTO_SWEEP_INTERVAL": 300,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"idempotency_app": {"handlers": ["console"], "level": "INFO"}},
}
