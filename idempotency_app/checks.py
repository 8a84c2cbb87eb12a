"""System checks for ``IDEMPOTENCY``; ids are documented in the README."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import django
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.utils.module_loading import import_string

from idempotency_app.conf import DEFAULTS, SAFE_METHODS, conf

MIN_TTL = 60
MAX_TTL = 30 * 24 * 3600
LOCAL_CACHE_BACKENDS = (
    "django.core.cache.backends.locmem.LocMemCache",
    "django.core.cache.backends.dummy.DummyCache",
)
DURATION_KEYS = (
    "TTL",
    "LEASE",
    "TRANSIENT_ERROR_TTL",
    "WAIT_FOR_IN_FLIGHT",
    "CACHE_RETRY_INTERVAL",
    "AUTO_SWEEP_INTERVAL",
)


@register(Tags.compatibility)
def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    raw = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(raw, dict):
        return [
            Error(
                "IDEMPOTENCY must be a dict.",
                hint="Set IDEMPOTENCY = {...} or remove it.",
                id="idempotency_app.E001",
            )
        ]
    errors: list[CheckMessage] = []
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        errors.append(
            Error(
                f"IDEMPOTENCY has unknown keys: {', '.join(unknown)}.",
                hint=f"Check the spelling; known keys are {', '.join(sorted(DEFAULTS))}.",
                id="idempotency_app.E002",
            )
        )
    bad_durations = [k for k in DURATION_KEYS if not _is_duration(raw.get(k, DEFAULTS[k]))]
    for name in bad_durations:
        errors.append(
            Error(
                f"IDEMPOTENCY['{name}'] must be a number of seconds or a timedelta, not {raw[name]!r}.",
                id="idempotency_app.E003",
            )
        )
    if not bad_durations:
        errors.extend(_check_bounds())
    errors.extend(_check_aliases())
    errors.extend(_check_callables(raw))
    return errors


def _is_duration(value: Any) -> bool:
    return isinstance(value, timedelta) or (
        isinstance(value, int | float) and not isinstance(value, bool)
    )


def _check_bounds() -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    if not MIN_TTL <= conf.TTL <= MAX_TTL:
        errors.append(
            Error(
                f"IDEMPOTENCY['TTL'] is {conf.TTL:g}s; it must be from {MIN_TTL}s (1 minute) to {MAX_TTL}s (30 days).",
                id="idempotency_app.E004",
            )
        )
    if not 1 <= conf.LEASE < conf.TTL:
        errors.append(
            Error(
                f"IDEMPOTENCY['LEASE'] is {conf.LEASE:g}s; it must be at least 1s and shorter than TTL ({conf.TTL:g}s).",
                hint="LEASE should exceed your slowest idempotent view.",
                id="idempotency_app.E005",
            )
        )
    optional = (
        "TRANSIENT_ERROR_TTL",
        "WAIT_FOR_IN_FLIGHT",
        "CACHE_RETRY_INTERVAL",
        "AUTO_SWEEP_INTERVAL",
    )
    if not all(0 <= getattr(conf, name) < math.inf for name in optional):
        errors.append(
            Error(
                "IDEMPOTENCY durations TRANSIENT_ERROR_TTL, WAIT_FOR_IN_FLIGHT, CACHE_RETRY_INTERVAL and AUTO_SWEEP_INTERVAL must be finite and not negative.",
                id="idempotency_app.E006",
            )
        )
    if conf.WAIT_FOR_IN_FLIGHT >= conf.LEASE:
        errors.append(
            Error(
                "IDEMPOTENCY['WAIT_FOR_IN_FLIGHT'] must be shorter than LEASE.",
                hint="A duplicate should give up waiting before the first request's lease can lapse.",
                id="idempotency_app.E007",
            )
        )
    if 0 < conf.AUTO_SWEEP_INTERVAL < 1:
        errors.append(
            Error(
                f"IDEMPOTENCY['AUTO_SWEEP_INTERVAL'] is {conf.AUTO_SWEEP_INTERVAL:g}s; use 0 (off) or at least 1s.",
                hint="Each round costs a few statements; minutes are typical.",
                id="idempotency_app.E016",
            )
        )
    max_body = conf.user_settings.get("MAX_BODY_BYTES", DEFAULTS["MAX_BODY_BYTES"])
    if not isinstance(max_body, int) or isinstance(max_body, bool) or max_body < 0:
        errors.append(
            Error(
                f"IDEMPOTENCY['MAX_BODY_BYTES'] must be a whole number of bytes, not {max_body!r}.",
                id="idempotency_app.E008",
            )
        )
    return errors


def _check_aliases() -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    if conf.CACHE_ALIAS not in settings.CACHES:
        errors.append(
            Error(
                f"IDEMPOTENCY['CACHE_ALIAS'] is {conf.CACHE_ALIAS!r}, which is not in CACHES.",
                hint=f"Use one of: {', '.join(settings.CACHES)}.",
                id="idempotency_app.E009",
            )
        )
    if conf.DATABASE_ALIAS not in settings.DATABASES:
        errors.append(
            Error(
                f"IDEMPOTENCY['DATABASE_ALIAS'] is {conf.DATABASE_ALIAS!r}, which is not in DATABASES.",
                id="idempotency_app.E010",
            )
        )
        return errors
    database = settings.DATABASES[conf.DATABASE_ALIAS]
    if database.get("ATOMIC_REQUESTS"):
        errors.append(
            Warning(
                f"ATOMIC_REQUESTS is on for database {conf.DATABASE_ALIAS!r}: a claim cannot commit "
                "before its view runs, so a concurrent duplicate waits for the first request "
                "instead of getting 409 at once.",
                hint="This is safe. For immediate 409s, exclude idempotent views with "
                "transaction.non_atomic_requests; the idempotency layer then runs each view in "
                "its own transaction.",
                id="idempotency_app.W001",
            )
        )
    sqlite = "sqlite3" in database.get("ENGINE", "")
    immediate_supported = django.VERSION >= (5, 1)
    if (
        sqlite
        and immediate_supported
        and dict(database.get("OPTIONS") or {}).get("transaction_mode") != "IMMEDIATE"
    ):
        errors.append(
            Warning(
                f"Database {conf.DATABASE_ALIAS!r} is SQLite with deferred transactions: a duplicate's "
                "claim written while a request's transaction runs can make that request fail with "
                "'database is locked'.",
                hint='On Django 5.1+ set OPTIONS = {"transaction_mode": "IMMEDIATE"}; '
                "use PostgreSQL or MySQL for concurrent production traffic.",
                id="idempotency_app.W003",
            )
        )
    cache = settings.CACHES.get(conf.CACHE_ALIAS, {})
    if cache.get("BACKEND") == "django.core.cache.backends.db.DatabaseCache":
        errors.append(
            Warning(
                f"IDEMPOTENCY['CACHE_ALIAS'] {conf.CACHE_ALIAS!r} is a database cache: on the "
                "database that holds the records, a cached validation error is written in the "
                "request's transaction and rolled back with it, so the retry-storm guard never "
                "holds.",
                hint="Point CACHE_ALIAS at a django-redis cache.",
                id="idempotency_app.W006",
            )
        )
    server_db = not sqlite
    if server_db and cache.get("BACKEND") in LOCAL_CACHE_BACKENDS:
        errors.append(
            Warning(
                f"IDEMPOTENCY['CACHE_ALIAS'] {conf.CACHE_ALIAS!r} is a per-process cache "
                f"({cache.get('BACKEND')}) while the database is a server: processes will not share "
                "the retry-storm guard.",
                hint="Point CACHE_ALIAS at a django-redis cache.",
                id="idempotency_app.W002",
            )
        )
    return errors


def _check_callables(raw: dict[str, Any]) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    for name in ("SCOPE", "FINGERPRINT"):
        value = raw.get(name, DEFAULTS[name])
        if isinstance(value, str):
            try:
                import_string(value)
            except ImportError as exc:
                errors.append(
                    Error(
                        f"IDEMPOTENCY['{name}'] cannot be imported: {exc}.",
                        id="idempotency_app.E011",
                    )
                )
        elif not callable(value):
            errors.append(
                Error(
                    f"IDEMPOTENCY['{name}'] must be a dotted path or a callable.",
                    id="idempotency_app.E011",
                )
            )
    return errors


APP_LABEL = "idempotency_app"
SUPPORTED_VENDORS = ("postgresql", "mysql", "sqlite")
# RFC 9110 token characters: what a header name may be made of.
TOKEN_CHARS = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
LIST_KEYS = ("METHODS", "STORE_HEADERS", "FINGERPRINT_QUERY_PARAMS", "FINGERPRINT_HEADERS")


@register(Tags.models)
def check_migrations(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """The model and its migrations agree, judged without touching a database.

    Only this app's models are compared, so the cost does not grow with the
    project. Nothing is reported when the app's migrations are disabled
    (``MIGRATION_MODULES = {"idempotency_app": None}``), as some test setups do.
    """
    from django.apps import apps
    from django.db.migrations.autodetector import MigrationAutodetector
    from django.db.migrations.loader import MigrationLoader
    from django.db.migrations.state import ProjectState

    if app_configs is not None and APP_LABEL not in {c.label for c in app_configs}:
        return []
    loader = MigrationLoader(None, ignore_no_migrations=True)
    if APP_LABEL not in loader.migrated_apps:
        return []
    migrated = loader.project_state(loader.graph.leaf_nodes(APP_LABEL))
    current = ProjectState.from_apps(apps)
    changes = MigrationAutodetector(_only_app(migrated), _only_app(current)).changes(
        graph=loader.graph, trim_to_apps={APP_LABEL}
    )
    if not changes.get(APP_LABEL):
        return []
    return [
        Error(
            "The idempotency_app models have changes that are not in its migrations.",
            hint="Upgrade idempotency_app so that its model and migrations match; never write "
            "your own migration for it (run `manage.py makemigrations --check idempotency_app` "
            "to see the difference). When developing idempotency_app itself, run makemigrations.",
            id="idempotency_app.E012",
        )
    ]


def _only_app(state: Any) -> Any:
    from django.db.migrations.state import ProjectState

    return ProjectState({k: v for k, v in state.models.items() if k[0] == APP_LABEL})


@register(Tags.compatibility)
def check_header_and_lists(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Shapes the settings object trusts: a mistyped header name never
    matches a request, and ``METHODS = "POST"`` reads as the letters P, O, S, T."""
    raw = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(raw, dict):
        return []  # E001 says so
    errors: list[CheckMessage] = []
    header = raw.get("HEADER", DEFAULTS["HEADER"])
    if not isinstance(header, str) or not header or not set(header) <= TOKEN_CHARS:
        errors.append(
            Error(
                f"IDEMPOTENCY['HEADER'] is {header!r}, which is not an HTTP header name.",
                hint="Use letters, digits and '-' as a client sends it, e.g. 'Idempotency-Key'.",
                id="idempotency_app.E013",
            )
        )
    for name in LIST_KEYS:
        value = raw.get(name, DEFAULTS[name])
        if not isinstance(value, list | tuple | set | frozenset) or not all(
            isinstance(v, str) and v for v in value
        ):
            errors.append(
                Error(
                    f"IDEMPOTENCY['{name}'] must be a list of non-empty strings, not {value!r}.",
                    hint='Write a list even for one value: ["POST"], not "POST".',
                    id="idempotency_app.E014",
                )
            )
        elif name == "METHODS" and {m.upper() for m in value} & SAFE_METHODS:
            safe = sorted({m.upper() for m in value} & SAFE_METHODS)
            errors.append(
                Error(
                    f"IDEMPOTENCY['METHODS'] names {', '.join(safe)}: safe methods change "
                    "nothing, so they never claim a key.",
                    hint="Remove them; the mixin covers only unsafe methods.",
                    id="idempotency_app.E017",
                )
            )
    return errors


@register(Tags.compatibility)
def check_view_options(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Each view's ttl/lease/wait, combined with the settings it leaves to
    them, must be safe: ``lease=5`` with ``WAIT_FOR_IN_FLIGHT = 10`` would
    let a waiting duplicate take over a live request."""
    from idempotency_app.core import policy_problems
    from idempotency_app.drf import declared_options

    errors: list[CheckMessage] = []
    for name, options in declared_options():
        problems = policy_problems(
            conf.TTL if options.ttl is None else options.ttl,
            conf.LEASE if options.lease is None else options.lease,
            conf.WAIT_FOR_IN_FLIGHT if options.wait is None else options.wait,
        )
        if problems:
            errors.append(
                Error(
                    f"The idempotency options of {name}, with the IDEMPOTENCY setting: "
                    + " ".join(problems),
                    hint="Give the view a lease above its wait, or change the setting.",
                    id="idempotency_app.E018",
                )
            )
    return errors


@register(Tags.database)
def check_transactions(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Configurations in which a view's work cannot commit with its stored
    outcome. Judged from settings alone; no connection is opened."""
    alias = conf.DATABASE_ALIAS
    if alias not in settings.DATABASES:
        return []  # E010 says so
    errors: list[CheckMessage] = []
    elsewhere = sorted(
        other
        for other, database in settings.DATABASES.items()
        if other != alias and database.get("ATOMIC_REQUESTS")
    )
    if elsewhere:
        errors.append(
            Warning(
                f"ATOMIC_REQUESTS is on for {', '.join(map(repr, elsewhere))}, but idempotency "
                f"records are stored on {alias!r}: an idempotent view's writes there cannot "
                "commit together with its stored outcome, so they are refused (CannotBeAtomic).",
                hint="Point IDEMPOTENCY['DATABASE_ALIAS'] at the database your idempotent views "
                "write to.",
                id="idempotency_app.W004",
            )
        )
    from idempotency_app.store import narrow_mysql_charset

    database = settings.DATABASES[alias]
    charset = narrow_mysql_charset(database)
    if "mysql" in database.get("ENGINE", "") and charset is not None:
        errors.append(
            Warning(
                f"Database {alias!r} is MySQL/MariaDB with the {charset} connection character "
                "set: a key, scope or operation with characters outside the Basic Multilingual "
                "Plane (emoji) cannot be stored exactly, and is refused.",
                hint='Set DATABASES[...]["OPTIONS"] = {"charset": "utf8mb4"}.',
                id="idempotency_app.W005",
            )
        )
    from idempotency_app.drivers import reports_transactions

    if "mysql" in database.get("ENGINE", "") and not reports_transactions("mysql"):
        errors.append(
            Warning(
                f"Database {alias!r} is MySQL/MariaDB through a mysqlclient that is not built "
                "against MariaDB Connector/C, so it cannot report whether idempotent work's "
                "transaction is still open: a transaction the work ends in a way the statement "
                "rules cannot see (a procedure, a prepared statement, the driver's own commit()) "
                "goes unnoticed, and a retry may run the work again.",
                hint="Install mysqlclient built against MariaDB Connector/C (libmariadb), as "
                "its wheels and Debian's libmariadb-dev are.",
                id="idempotency_app.W010",
            )
        )
    return errors


@register(Tags.compatibility)
def check_database_vendor(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """The store's claim is vendor-specific SQL; other databases would fail
    at the first request instead of at start-up. No connection is opened."""
    from django.db import connections

    alias = conf.DATABASE_ALIAS
    if alias not in connections.settings:
        return []  # E010 says so
    vendor = connections[alias].vendor
    if vendor in SUPPORTED_VENDORS:
        return []
    return [
        Error(
            f"Database {alias!r} is {vendor}; idempotency_app supports PostgreSQL, "
            "MySQL/MariaDB and SQLite.",
            hint="Point IDEMPOTENCY['DATABASE_ALIAS'] at a supported database.",
            id="idempotency_app.E015",
        )
    ]
