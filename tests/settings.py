"""Test settings. The backend comes from the environment:

IDEMPOTENCY_TEST_DB         sqlite (default) | postgres | mysql
IDEMPOTENCY_TEST_DB_HOST    default 127.0.0.1
IDEMPOTENCY_TEST_DB_PORT    default 5432 (postgres) / 3306 (mysql)
IDEMPOTENCY_TEST_DB_USER    default postgres / root
IDEMPOTENCY_TEST_DB_PASSWORD  default empty
IDEMPOTENCY_TEST_DB_NAME    default test (the test run uses test_<name>)
IDEMPOTENCY_TEST_PG_PREPARE  PostgreSQL OPTIONS prepare_threshold (unset: Django's default, off)
IDEMPOTENCY_TEST_REDIS_URL  e.g. redis://127.0.0.1:6379/0; unset = local-memory cache
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from typing import Any

import django

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "rest_framework",
    "idempotency_app",
    "tests.testapp",
    "example_project.payments",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
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

DATABASES: dict[str, dict[str, Any]]
CACHES: dict[str, dict[str, Any]]
DB = os.environ.get("IDEMPOTENCY_TEST_DB", "sqlite").lower()
_host = os.environ.get("IDEMPOTENCY_TEST_DB_HOST", "127.0.0.1")
_name = os.environ.get("IDEMPOTENCY_TEST_DB_NAME", "test")
_password = os.environ.get("IDEMPOTENCY_TEST_DB_PASSWORD", "")
if DB in ("postgres", "postgresql"):
    DB = "postgres"
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "HOST": _host,
            "PORT": os.environ.get("IDEMPOTENCY_TEST_DB_PORT", "5432"),
            "USER": os.environ.get("IDEMPOTENCY_TEST_DB_USER", "postgres"),
            "PASSWORD": _password,
            "NAME": _name,
            # IDEMPOTENCY_TEST_PG_PREPARE=5: psycopg prepares the claim (off
            # by default in Django, as here).
            "OPTIONS": (
                {"prepare_threshold": int(os.environ["IDEMPOTENCY_TEST_PG_PREPARE"])}
                if os.environ.get("IDEMPOTENCY_TEST_PG_PREPARE")
                else {}
            ),
        }
    }
elif DB in ("mysql", "mariadb"):
    DB = "mysql"
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "HOST": _host,
            "PORT": os.environ.get("IDEMPOTENCY_TEST_DB_PORT", "3306"),
            "USER": os.environ.get("IDEMPOTENCY_TEST_DB_USER", "root"),
            "PASSWORD": _password,
            "NAME": _name,
            "OPTIONS": {"charset": "utf8mb4"},
            "TEST": {"CHARSET": "utf8mb4"},
        }
    }
elif DB == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": ":memory:",
            "OPTIONS": {"transaction_mode": "IMMEDIATE"} if django.VERSION >= (5, 1) else {},
        }
    }
else:
    raise RuntimeError(f"IDEMPOTENCY_TEST_DB={DB!r}: use sqlite, postgres or mysql.")
# A second database, for the views that write where their outcome is not stored.
DATABASES["other"] = {
    **DATABASES["default"],
    "NAME": ":memory:" if DB == "sqlite" else f"{_name}_other",
}

REDIS_URL = os.environ.get("IDEMPOTENCY_TEST_REDIS_URL", "")
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": f"idempotency-tests-{os.getpid()}",
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.2, "SOCKET_TIMEOUT": 0.2},
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
    "DEFAULT_THROTTLE_RATES": {"burst": "3/minute"},
    # Views annotated with @extend_schema bind to it when they are defined.
    "DEFAULT_SCHEMA_CLASS": "idempotency_app.integrations.openapi.AutoSchema",
}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# django.tasks (Django 6.0+, or the django-tasks backport) with a
# database-backed backend, where installed: the enqueue_once tests and the
# worker races use it.
TASKS_INSTALLED = find_spec("django_tasks_db") is not None and (
    django.VERSION >= (6, 0) or find_spec("django_tasks") is not None
)
if TASKS_INSTALLED:
    INSTALLED_APPS.append("django_tasks_db")
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
