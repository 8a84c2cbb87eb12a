"""The ``IDEMPOTENCY`` settings dict, read through ``conf``.

The dict is looked up on ``django.conf.settings`` once, and again after
Django's ``setting_changed`` names it (``override_settings``, pytest-django's
``settings`` fixture), so ``override_settings(IDEMPOTENCY={...})`` takes
effect at once in tests; keys are read from it on every access, so a change
made to the dict in place is seen too. A change that Django does not
signal (assigning ``django.conf.settings.IDEMPOTENCY`` at run time, which
Django rules out, or pytest-django's ``del settings.IDEMPOTENCY``) is seen
at the next one that it does. Nothing is written back onto
``django.conf.settings``.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

DEFAULTS: dict[str, Any] = {
    "ENABLED": True,
    "HEADER": "Idempotency-Key",
    "TTL": 24 * 3600,
    "LEASE": 60,
    "TRANSIENT_ERROR_TTL": 10,
    "CACHE_ALIAS": "default",
    "DATABASE_ALIAS": "default",
    "METHODS": ["POST", "PATCH"],
    "SCOPE": "idempotency_app.http.keys.user_scope",
    "FINGERPRINT": "idempotency_app.http.keys.fingerprint",
    "FINGERPRINT_QUERY_PARAMS": [],
    "FINGERPRINT_HEADERS": [],
    "STORE_HEADERS": [],
    "MAX_BODY_BYTES": 1024 * 1024,
    "WAIT_FOR_IN_FLIGHT": 0,
    "CACHE_RETRY_INTERVAL": 5,
    "AUTO_SWEEP_INTERVAL": 0,
    "REPLAY_CACHE": 0,
    "REPLAY_CACHE_ENTRIES": 1000,
    "ERROR_FORMAT": "detail",
    "PROBLEM_TYPE_BASE": "urn:idempotency-app:problem:",
}

# The longest TTL: a record must expire within the databases' calendars.
MAX_TTL = 30 * 24 * 3600
# The longest REPLAY_CACHE may be: how long another process may replay a
# record an operator has expired. A record expiring sooner is never held.
MAX_REPLAY_CACHE = 60

# Safe methods change nothing, so a key never makes them claim anything.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

# Representation headers: what a client needs to read a replayed body the way
# it read the original (a compressed body, an attachment's file name).
# Cookies, auth and hop-by-hop headers never qualify.
DEFAULT_STORED_HEADERS = (
    "Content-Type",
    "Content-Encoding",
    "Content-Disposition",
    "Content-Language",
    "Content-Location",
    "Location",
    "ETag",
    "Last-Modified",
    "Link",
)
NEVER_STORED_HEADERS = frozenset(
    h.lower()
    for h in (
        "Set-Cookie",
        "Authorization",
        "WWW-Authenticate",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Connection",
        "Keep-Alive",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Content-Length",
    )
)


def never_stored(name: str) -> bool:
    """Credentials, cookies and hop-by-hop headers, including every Proxy-* header."""
    lowered = name.lower()
    return lowered in NEVER_STORED_HEADERS or lowered.startswith("proxy-")


def to_seconds(value: float | timedelta) -> float:
    """Durations may be given as seconds or as a ``timedelta``."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def is_duration(value: Any) -> bool:
    """A number of seconds (not a bool) or a ``timedelta``."""
    return isinstance(value, timedelta) or (
        isinstance(value, int | float) and not isinstance(value, bool)
    )


def policy_problems(ttl: float, lease: float, wait: float) -> list[str]:
    """What makes a combination of durations unsafe, in words: the one rule
    that the settings' checks, per-view options and per-call options all
    apply. Per-view and per-call options may be shorter than the settings
    allow (a task's TTL of a few seconds, say), never unsafe."""
    problems = []
    if not 0 < ttl <= MAX_TTL:
        problems.append(
            f"TTL is {ttl:g}s; it must be a positive number of seconds, at most {MAX_TTL}s "
            "(30 days)."
        )
    if not 0 < lease < math.inf:
        problems.append(f"LEASE is {lease:g}s; it must be a positive number of seconds.")
    if not 0 <= wait < lease:
        problems.append(
            f"WAIT_FOR_IN_FLIGHT is {wait:g}s; it must be at least 0 and shorter than "
            f"LEASE ({lease:g}s), or a waiting duplicate could take over a live request."
        )
    return problems


class Settings:
    """Typed view of ``settings.IDEMPOTENCY``; every key is optional."""

    # The dict itself, until setting_changed names it: a request reads the
    # settings about 17 times, and Django's lazy settings object costs more
    # than the dict lookup.
    _user_settings: dict[str, Any] | None = None

    @property
    def user_settings(self) -> dict[str, Any]:
        user = self._user_settings
        if user is None:
            value = getattr(settings, "IDEMPOTENCY", None)
            user = self._user_settings = value if isinstance(value, dict) else {}
        return user

    def _get(self, name: str) -> Any:
        user = self._user_settings  # read here, not through the property: 17 times a request
        if user is None:
            user = self.user_settings
        return user.get(name, DEFAULTS[name])

    def values(self, names: tuple[str, ...]) -> tuple[Any, ...]:
        """The settings ``names`` as given, unconverted: a key for what is
        made of them once (``claims.Policy.from_settings``)."""
        user = self._user_settings
        if user is None:
            user = self.user_settings
        return tuple([user.get(name, DEFAULTS[name]) for name in names])

    @property
    def ENABLED(self) -> bool:
        return bool(self._get("ENABLED"))

    @property
    def HEADER(self) -> str:
        return str(self._get("HEADER"))

    @property
    def TTL(self) -> float:
        return to_seconds(self._get("TTL"))

    @property
    def LEASE(self) -> float:
        return to_seconds(self._get("LEASE"))

    @property
    def TRANSIENT_ERROR_TTL(self) -> float:
        return to_seconds(self._get("TRANSIENT_ERROR_TTL"))

    @property
    def CACHE_ALIAS(self) -> str:
        return str(self._get("CACHE_ALIAS"))

    @property
    def DATABASE_ALIAS(self) -> str:
        return str(self._get("DATABASE_ALIAS"))

    @property
    def METHODS(self) -> frozenset[str]:
        return _upper(tuple(self._get("METHODS")))

    @property
    def SCOPE(self) -> Callable[..., str | None]:
        return resolve_callable(self._get("SCOPE"))

    @property
    def FINGERPRINT(self) -> Callable[..., str]:
        return resolve_callable(self._get("FINGERPRINT"))

    @property
    def FINGERPRINT_QUERY_PARAMS(self) -> list[str]:
        return list(self._get("FINGERPRINT_QUERY_PARAMS"))

    @property
    def FINGERPRINT_HEADERS(self) -> list[str]:
        return list(self._get("FINGERPRINT_HEADERS"))

    @property
    def STORED_HEADERS(self) -> frozenset[str]:
        return _stored_headers(tuple(self._get("STORE_HEADERS")))

    @property
    def MAX_BODY_BYTES(self) -> int:
        return int(self._get("MAX_BODY_BYTES"))

    @property
    def WAIT_FOR_IN_FLIGHT(self) -> float:
        return to_seconds(self._get("WAIT_FOR_IN_FLIGHT"))

    @property
    def CACHE_RETRY_INTERVAL(self) -> float:
        return to_seconds(self._get("CACHE_RETRY_INTERVAL"))

    @property
    def AUTO_SWEEP_INTERVAL(self) -> float:
        return to_seconds(self._get("AUTO_SWEEP_INTERVAL"))

    @property
    def REPLAY_CACHE(self) -> float:
        """Seconds a process may answer a retry from the responses it holds
        (``lifecycle.replays``); 0: never."""
        return to_seconds(self._get("REPLAY_CACHE"))

    @property
    def REPLAY_CACHE_ENTRIES(self) -> int:
        return int(self._get("REPLAY_CACHE_ENTRIES"))

    @property
    def ERROR_FORMAT(self) -> str:
        """``detail``, ``problem`` or ``handler``: see ``idempotency_app.problems``."""
        return str(self._get("ERROR_FORMAT"))

    @property
    def PROBLEM_TYPE_BASE(self) -> str:
        return str(self._get("PROBLEM_TYPE_BASE"))


def resolve_callable(value: str | Callable[..., Any]) -> Callable[..., Any]:
    """Settings and per-view options take a dotted path or the callable
    itself. A path is looked up on every call, so a hook patched in a test
    is the one that runs: read off its module once that is imported (an
    attribute read), else by Django's ``import_string``, which waits for a
    module another thread is still importing."""
    if not isinstance(value, str):
        return value
    module_name, name = _split_path(value)
    module = sys.modules.get(module_name)
    spec = getattr(module, "__spec__", None)
    found = None
    if spec is not None and getattr(spec, "_initializing", False) is False:
        found = getattr(module, name, None)
    resolved: Callable[..., Any] = found if callable(found) else import_string(value)
    return resolved


# What settings turn into, computed once per value rather than per request.
# Keyed by the value itself, so override_settings is seen at once.


@functools.lru_cache(maxsize=64)
def _split_path(path: str) -> tuple[str, str]:
    module_name, _, name = path.rpartition(".")
    return module_name, name


@functools.lru_cache(maxsize=16)
def _upper(methods: tuple[str, ...]) -> frozenset[str]:
    return frozenset(m.upper() for m in methods)


@functools.lru_cache(maxsize=16)
def _stored_headers(extra: tuple[str, ...]) -> frozenset[str]:
    names = {n.lower() for n in (*DEFAULT_STORED_HEADERS, *extra)}
    return frozenset(n for n in names if not never_stored(n))


conf = Settings()


def _reread(setting: str, **kwargs: Any) -> None:
    if setting == "IDEMPOTENCY":
        conf._user_settings = None


setting_changed.connect(_reread, dispatch_uid="idempotency_app.conf")
