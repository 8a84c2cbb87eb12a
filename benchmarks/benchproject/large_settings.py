"""The bench settings pointed at the large tables, with the admin installed.

``large_table.py`` drives the real admin changelist and the sweep command on
a table of a million records. Everything it creates (the records, the auth
and session tables, the superuser) lives in ``bench_large``: a schema of the
bench database on PostgreSQL, a database of its own on MariaDB. The load
benchmark keeps its lean settings; only this module adds the admin.
"""

from __future__ import annotations

from benchmarks.benchproject.settings import *  # noqa: F403
from benchmarks.benchproject.settings import DATABASES, INSTALLED_APPS

DATABASES["default"] = DATABASES["large"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.sessions",
    "django.contrib.messages",
    *INSTALLED_APPS,
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
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
ROOT_URLCONF = "benchmarks.benchproject.large_urls"
