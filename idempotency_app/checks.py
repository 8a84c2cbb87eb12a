"""Every system check of idempotency_app, and the one table of their IDs.

``IdempotencyConfig.ready()`` registers them (``register_all``); nothing is
registered by importing a module. Each message is made by ``_message`` from
an ID in ``CHECKS``, which docs/reference.md lists (a test holds the two
together). Checks judge settings and code, and open no connection.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import django
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils.module_loading import import_string
from rest_framework.settings import api_settings
from rest_framework.views import APIView

from idempotency_app.conf import DEFAULTS, MAX_REPLAY_CACHE, MAX_TTL, SAFE_METHODS, conf

# Every check's ID (after "idempotency_app.") and what it finds.
CHECKS: dict[str, str] = {
    "E001": "IDEMPOTENCY is not a dict",
    "E002": "unknown keys in IDEMPOTENCY",
    "E003": "a duration is neither a number nor a timedelta",
    "E004": "TTL outside 1 minute to 30 days",
    "E005": "LEASE under 1 s or not shorter than TTL",
    "E006": "a negative or infinite optional duration",
    "E007": "WAIT_FOR_IN_FLIGHT not shorter than LEASE",
    "E008": "MAX_BODY_BYTES is not a whole, non-negative number",
    "E009": "CACHE_ALIAS is not in CACHES",
    "E010": "DATABASE_ALIAS is not in DATABASES",
    "E011": "SCOPE or FINGERPRINT cannot be imported or is not callable",
    "E012": "the app's models differ from its migrations",
    "E013": "HEADER is not an HTTP header name",
    "E014": "a list setting is not a list of strings",
    "E015": "DATABASE_ALIAS is not PostgreSQL, MySQL/MariaDB or SQLite",
    "E016": "AUTO_SWEEP_INTERVAL between 0 and 1 second",
    "E017": "METHODS names a safe method",
    "E018": "a view's ttl/lease/wait options are unsafe with the settings",
    "E019": "ERROR_FORMAT is not detail, problem or handler",
    "E020": "PROBLEM_TYPE_BASE is not an absolute URI",
    "E021": "REPLAY_CACHE over 60 seconds",
    "E022": "REPLAY_CACHE_ENTRIES is not a whole number of at least 1",
    "E030": "an @idempotent view is served without DRF",
    "W001": "ATOMIC_REQUESTS is on: duplicates wait instead of getting 409",
    "W002": "the guard's cache is per-process while the database is a server",
    "W003": "SQLite with deferred transactions",
    "W004": "ATOMIC_REQUESTS is on for a database other than DATABASE_ALIAS",
    "W005": "MySQL/MariaDB with a connection character set other than utf8mb4",
    "W006": "the guard's cache is a database cache",
    "W007": "drf-standardized-errors' handler with ERROR_FORMAT detail",
    "W008": "CORS_ALLOW_HEADERS does not allow the key header",
    "W009": "CORS_EXPOSE_HEADERS lacks the protocol's response headers",
    "W010": "mysqlclient cannot report whether a transaction is open",
}


def _message(code: str, msg: str, hint: str | None = None, obj: Any = None) -> CheckMessage:
    """The check ``code`` of ``CHECKS``: an Error for E..., a Warning for W..."""
    if code not in CHECKS:
        raise KeyError(f"{code} is not in CHECKS")
    level = Error if code.startswith("E") else Warning
    return level(msg, hint=hint, obj=obj, id=f"idempotency_app.{code}")


def register_all() -> None:
    """Called once by ``IdempotencyConfig.ready()``."""
    from django.apps import apps

    register(check_settings, Tags.compatibility)
    register(check_migrations, Tags.models)
    register(check_header_and_lists, Tags.compatibility)
    register(check_view_options, Tags.compatibility)
    register(check_transactions, Tags.database)
    register(check_database_vendor, Tags.compatibility)
    register(check_error_format, Tags.compatibility)
    register(check_idempotent_views, Tags.urls)
    if apps.is_installed("corsheaders"):
        register(check_cors_headers, Tags.security)


MIN_TTL = 60
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
    "REPLAY_CACHE",
)


def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    raw = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(raw, dict):
        return [
            _message(
                "E001",
                "IDEMPOTENCY must be a dict.",
                hint="Set IDEMPOTENCY = {...} or remove it.",
            )
        ]
    errors: list[CheckMessage] = []
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        errors.append(
            _message(
                "E002",
                f"IDEMPOTENCY has unknown keys: {', '.join(unknown)}.",
                hint=f"Check the spelling; known keys are {', '.join(sorted(DEFAULTS))}.",
            )
        )
    bad_durations = [k for k in DURATION_KEYS if not _is_duration(raw.get(k, DEFAULTS[k]))]
    for name in bad_durations:
        errors.append(
            _message(
                "E003",
                f"IDEMPOTENCY['{name}'] must be a number of seconds or a timedelta, not {raw[name]!r}.",
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
            _message(
                "E004",
                f"IDEMPOTENCY['TTL'] is {conf.TTL:g}s; it must be from {MIN_TTL}s (1 minute) to {MAX_TTL}s (30 days).",
            )
        )
    if not 1 <= conf.LEASE < conf.TTL:
        errors.append(
            _message(
                "E005",
                f"IDEMPOTENCY['LEASE'] is {conf.LEASE:g}s; it must be at least 1s and shorter than TTL ({conf.TTL:g}s).",
                hint="LEASE should exceed your slowest idempotent view.",
            )
        )
    optional = (
        "TRANSIENT_ERROR_TTL",
        "WAIT_FOR_IN_FLIGHT",
        "CACHE_RETRY_INTERVAL",
        "AUTO_SWEEP_INTERVAL",
        "REPLAY_CACHE",
    )
    if not all(0 <= getattr(conf, name) < math.inf for name in optional):
        errors.append(
            _message(
                "E006",
                "IDEMPOTENCY durations TRANSIENT_ERROR_TTL, WAIT_FOR_IN_FLIGHT, CACHE_RETRY_INTERVAL, AUTO_SWEEP_INTERVAL and REPLAY_CACHE must be finite and not negative.",
            )
        )
    elif conf.REPLAY_CACHE > MAX_REPLAY_CACHE:
        errors.append(
            _message(
                "E021",
                f"IDEMPOTENCY['REPLAY_CACHE'] is {conf.REPLAY_CACHE:g}s; it must be at most {MAX_REPLAY_CACHE}s.",
                hint="Other processes replay an expired record for up to this long; a few seconds absorb a retry storm.",
            )
        )
    if conf.WAIT_FOR_IN_FLIGHT >= conf.LEASE:
        errors.append(
            _message(
                "E007",
                "IDEMPOTENCY['WAIT_FOR_IN_FLIGHT'] must be shorter than LEASE.",
                hint="A duplicate should give up waiting before the first request's lease can lapse.",
            )
        )
    if 0 < conf.AUTO_SWEEP_INTERVAL < 1:
        errors.append(
            _message(
                "E016",
                f"IDEMPOTENCY['AUTO_SWEEP_INTERVAL'] is {conf.AUTO_SWEEP_INTERVAL:g}s; use 0 (off) or at least 1s.",
                hint="Each round costs a few statements; minutes are typical.",
            )
        )
    entries = conf.user_settings.get("REPLAY_CACHE_ENTRIES", DEFAULTS["REPLAY_CACHE_ENTRIES"])
    if not isinstance(entries, int) or isinstance(entries, bool) or entries < 1:
        errors.append(
            _message(
                "E022",
                f"IDEMPOTENCY['REPLAY_CACHE_ENTRIES'] must be a whole number of at least 1, not {entries!r}.",
            )
        )
    max_body = conf.user_settings.get("MAX_BODY_BYTES", DEFAULTS["MAX_BODY_BYTES"])
    if not isinstance(max_body, int) or isinstance(max_body, bool) or max_body < 0:
        errors.append(
            _message(
                "E008",
                f"IDEMPOTENCY['MAX_BODY_BYTES'] must be a whole number of bytes, not {max_body!r}.",
            )
        )
    return errors


def _check_aliases() -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    if conf.CACHE_ALIAS not in settings.CACHES:
        errors.append(
            _message(
                "E009",
                f"IDEMPOTENCY['CACHE_ALIAS'] is {conf.CACHE_ALIAS!r}, which is not in CACHES.",
                hint=f"Use one of: {', '.join(settings.CACHES)}.",
            )
        )
    if conf.DATABASE_ALIAS not in settings.DATABASES:
        errors.append(
            _message(
                "E010",
                f"IDEMPOTENCY['DATABASE_ALIAS'] is {conf.DATABASE_ALIAS!r}, which is not in DATABASES.",
            )
        )
        return errors
    database = settings.DATABASES[conf.DATABASE_ALIAS]
    if database.get("ATOMIC_REQUESTS"):
        errors.append(
            _message(
                "W001",
                f"ATOMIC_REQUESTS is on for database {conf.DATABASE_ALIAS!r}: a claim cannot commit "
                "before its view runs, so a concurrent duplicate waits for the first request "
                "instead of getting 409 at once.",
                hint="This is safe. For immediate 409s, exclude idempotent views with "
                "transaction.non_atomic_requests; the idempotency layer then runs each view in "
                "its own transaction.",
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
            _message(
                "W003",
                f"Database {conf.DATABASE_ALIAS!r} is SQLite with deferred transactions: a duplicate's "
                "claim written while a request's transaction runs can make that request fail with "
                "'database is locked'.",
                hint='On Django 5.1+ set OPTIONS = {"transaction_mode": "IMMEDIATE"}; '
                "use PostgreSQL or MySQL for concurrent production traffic.",
            )
        )
    cache = settings.CACHES.get(conf.CACHE_ALIAS, {})
    if cache.get("BACKEND") == "django.core.cache.backends.db.DatabaseCache":
        errors.append(
            _message(
                "W006",
                f"IDEMPOTENCY['CACHE_ALIAS'] {conf.CACHE_ALIAS!r} is a database cache: on the "
                "database that holds the records, a cached validation error is written in the "
                "request's transaction and rolled back with it, so the retry-storm guard never "
                "holds.",
                hint="Point CACHE_ALIAS at a django-redis cache.",
            )
        )
    server_db = not sqlite
    if server_db and cache.get("BACKEND") in LOCAL_CACHE_BACKENDS:
        errors.append(
            _message(
                "W002",
                f"IDEMPOTENCY['CACHE_ALIAS'] {conf.CACHE_ALIAS!r} is a per-process cache "
                f"({cache.get('BACKEND')}) while the database is a server: processes will not share "
                "the retry-storm guard.",
                hint="Point CACHE_ALIAS at a django-redis cache.",
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
                    _message(
                        "E011",
                        f"IDEMPOTENCY['{name}'] cannot be imported: {exc}.",
                    )
                )
        elif not callable(value):
            errors.append(
                _message(
                    "E011",
                    f"IDEMPOTENCY['{name}'] must be a dotted path or a callable.",
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
        _message(
            "E012",
            "The idempotency_app models have changes that are not in its migrations.",
            hint="Upgrade idempotency_app so that its model and migrations match; never write "
            "your own migration for it (run `manage.py makemigrations --check idempotency_app` "
            "to see the difference). When developing idempotency_app itself, run makemigrations.",
        )
    ]


def _only_app(state: Any) -> Any:
    from django.db.migrations.state import ProjectState

    return ProjectState({k: v for k, v in state.models.items() if k[0] == APP_LABEL})


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
            _message(
                "E013",
                f"IDEMPOTENCY['HEADER'] is {header!r}, which is not an HTTP header name.",
                hint="Use letters, digits and '-' as a client sends it, e.g. 'Idempotency-Key'.",
            )
        )
    for name in LIST_KEYS:
        value = raw.get(name, DEFAULTS[name])
        if not isinstance(value, list | tuple | set | frozenset) or not all(
            isinstance(v, str) and v for v in value
        ):
            errors.append(
                _message(
                    "E014",
                    f"IDEMPOTENCY['{name}'] must be a list of non-empty strings, not {value!r}.",
                    hint='Write a list even for one value: ["POST"], not "POST".',
                )
            )
        elif name == "METHODS" and {m.upper() for m in value} & SAFE_METHODS:
            safe = sorted({m.upper() for m in value} & SAFE_METHODS)
            errors.append(
                _message(
                    "E017",
                    f"IDEMPOTENCY['METHODS'] names {', '.join(safe)}: safe methods change "
                    "nothing, so they never claim a key.",
                    hint="Remove them; the mixin covers only unsafe methods.",
                )
            )
    return errors


def check_view_options(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Each view's ttl/lease/wait, combined with the settings it leaves to
    them, must be safe: ``lease=5`` with ``WAIT_FOR_IN_FLIGHT = 10`` would
    let a waiting duplicate take over a live request."""
    from idempotency_app.conf import policy_problems
    from idempotency_app.http.options import declared_options

    errors: list[CheckMessage] = []
    for name, options in declared_options():
        problems = policy_problems(
            conf.TTL if options.ttl is None else options.ttl,
            conf.LEASE if options.lease is None else options.lease,
            conf.WAIT_FOR_IN_FLIGHT if options.wait is None else options.wait,
        )
        if problems:
            errors.append(
                _message(
                    "E018",
                    f"The idempotency options of {name}, with the IDEMPOTENCY setting: "
                    + " ".join(problems),
                    hint="Give the view a lease above its wait, or change the setting.",
                )
            )
    return errors


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
            _message(
                "W004",
                f"ATOMIC_REQUESTS is on for {', '.join(map(repr, elsewhere))}, but idempotency "
                f"records are stored on {alias!r}: an idempotent view's writes there cannot "
                "commit together with its stored outcome, so they are refused (CannotBeAtomic).",
                hint="Point IDEMPOTENCY['DATABASE_ALIAS'] at the database your idempotent views "
                "write to.",
            )
        )
    from idempotency_app.store.mysql import narrow_charset as narrow_mysql_charset

    database = settings.DATABASES[alias]
    charset = narrow_mysql_charset(database)
    if "mysql" in database.get("ENGINE", "") and charset is not None:
        errors.append(
            _message(
                "W005",
                f"Database {alias!r} is MySQL/MariaDB with the {charset} connection character "
                "set: a key, scope or operation with characters outside the Basic Multilingual "
                "Plane (emoji) cannot be stored exactly, and is refused.",
                hint='Set DATABASES[...]["OPTIONS"] = {"charset": "utf8mb4"}.',
            )
        )
    from idempotency_app.lifecycle.drivers import reports_transactions

    if "mysql" in database.get("ENGINE", "") and not reports_transactions("mysql"):
        errors.append(
            _message(
                "W010",
                f"Database {alias!r} is MySQL/MariaDB through a mysqlclient that is not built "
                "against MariaDB Connector/C, so it cannot report whether idempotent work's "
                "transaction is still open: a transaction the work ends in a way the statement "
                "rules cannot see (a procedure, a prepared statement, the driver's own commit()) "
                "goes unnoticed, and a retry may run the work again.",
                hint="Install mysqlclient built against MariaDB Connector/C (libmariadb), as "
                "its wheels and Debian's libmariadb-dev are.",
            )
        )
    return errors


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
        _message(
            "E015",
            f"Database {alias!r} is {vendor}; idempotency_app supports PostgreSQL, "
            "MySQL/MariaDB and SQLite.",
            hint="Point IDEMPOTENCY['DATABASE_ALIAS'] at a supported database.",
        )
    ]


def check_error_format(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """ERROR_FORMAT and PROBLEM_TYPE_BASE, and the exception handler they
    must suit (see ``idempotency_app.problems``)."""
    from idempotency_app.http.problems import FORMATS, is_standardized_errors

    raw = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(raw, dict):
        return []  # E001 says so
    errors: list[CheckMessage] = []
    error_format = raw.get("ERROR_FORMAT", DEFAULTS["ERROR_FORMAT"])
    if error_format not in FORMATS:
        errors.append(
            _message(
                "E019",
                f"IDEMPOTENCY['ERROR_FORMAT'] is {error_format!r}.",
                hint='Use "detail" ({"detail", "code"}), "problem" (RFC 9457 '
                'application/problem+json) or "handler" (a plain detail for your exception '
                "handler to shape).",
            )
        )
    base = raw.get("PROBLEM_TYPE_BASE", DEFAULTS["PROBLEM_TYPE_BASE"])
    if not isinstance(base, str) or not urlsplit(base).scheme or any(c.isspace() for c in base):
        errors.append(
            _message(
                "E020",
                f"IDEMPOTENCY['PROBLEM_TYPE_BASE'] is {base!r}, which is not an absolute URI.",
                hint='Use a URL such as "https://api.example.com/problems/" or a URN such as '
                '"urn:example:problem:"; each code is appended to it.',
            )
        )
    if error_format == "detail" and is_standardized_errors(api_settings.EXCEPTION_HANDLER):
        errors.append(
            _message(
                "W007",
                "REST_FRAMEWORK['EXCEPTION_HANDLER'] is drf-standardized-errors', which splits "
                'the {"detail", "code"} body of idempotency errors into two errors.',
                hint='Set IDEMPOTENCY["ERROR_FORMAT"] = "handler" so each is one error with '
                'its code, or "problem" for RFC 9457 problem details.',
            )
        )
    return errors


def check_idempotent_views(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``@idempotent`` needs DRF (or adrf) around it: a decorated function
    that the URLconf serves as a plain Django view would fail on every
    covered request; refused at start-up instead, naming the view."""
    errors: list[CheckMessage] = []
    for route, callback in _callbacks(get_resolver().url_patterns, ""):
        view_class = getattr(callback, "view_class", None)
        if hasattr(callback, "idempotency_options"):
            name = f"{callback.__module__}.{callback.__qualname__}"
        elif isinstance(view_class, type) and not issubclass(view_class, APIView):
            decorated = [
                method
                for method in getattr(view_class, "http_method_names", ())
                if hasattr(getattr(view_class, method, None), "idempotency_options")
            ]
            if not decorated:
                continue
            name = f"{view_class.__module__}.{view_class.__qualname__}.{decorated[0]}"
        else:
            continue
        errors.append(
            _message(
                "E030",
                f"{name} (route {route!r}) is decorated with @idempotent but served as a plain "
                "Django view, without DRF: every covered request would fail.",
                hint="Put @api_view([...]) above @idempotent (adrf.decorators.api_view for an "
                "async view), or base the class on DRF's or adrf's APIView. For a view that "
                "must stay plain Django, use idempotency_app.service.once() (or aonce()) inside it.",
                obj=callback,
            )
        )
    return errors


def _callbacks(patterns: Sequence[Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _callbacks(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern), pattern.callback


def check_cors_headers(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Browsers on other origins, behind django-cors-headers: the key must be
    an allowed request header, and the protocol's response headers exposed
    (``Retry-After`` is not CORS-safelisted either). Registered only where
    corsheaders is installed."""
    from corsheaders.conf import conf as cors_conf

    from idempotency_app.http.replay import EXPIRES_HEADER, REPLAYED_HEADER

    exposed_names = (REPLAYED_HEADER, EXPIRES_HEADER, "Retry-After")
    errors: list[CheckMessage] = []
    # "*" matches any header only for requests without credentials (Fetch).
    wildcard = not cors_conf.CORS_ALLOW_CREDENTIALS
    allowed = _lowered(cors_conf.CORS_ALLOW_HEADERS)
    header = conf.HEADER
    if allowed is not None and header.lower() not in allowed and not (wildcard and "*" in allowed):
        errors.append(
            _message(
                "W008",
                f"CORS_ALLOW_HEADERS does not allow {header!r}: browsers on other origins "
                "cannot send an idempotency key.",
                hint="from corsheaders.defaults import default_headers; "
                f'CORS_ALLOW_HEADERS = (*default_headers, "{header.lower()}")',
            )
        )
    exposed = _lowered(cors_conf.CORS_EXPOSE_HEADERS)
    if exposed is not None and not (wildcard and "*" in exposed):
        missing = [name for name in exposed_names if name.lower() not in exposed]
        if missing:
            listed = ", ".join(f'"{name}"' for name in missing)
            errors.append(
                _message(
                    "W009",
                    f"CORS_EXPOSE_HEADERS does not expose {', '.join(missing)}: scripts on other "
                    "origins cannot tell a replay, when to retry, or until when a retry replays.",
                    hint=f"Add them: CORS_EXPOSE_HEADERS = [..., {listed}]",
                )
            )
    return errors


def _lowered(names: Any) -> set[str] | None:
    """The names, lower-cased; None when the setting is malformed (django-cors-headers'
    own checks report that)."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        return None
    if not all(isinstance(name, str) for name in names):
        return None
    return {name.strip().lower() for name in names}
