"""Per-view options of ``@idempotent`` and ``IdempotentMixin``: checked when
the view is decorated or its class defined, so a mistake fails at import,
not on a client's request; and remembered, for the system check that judges
them against the settings and for the OpenAPI schema."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from idempotency_app.conf import SAFE_METHODS, is_duration, policy_problems, to_seconds


@dataclass(frozen=True)
class Options:
    """Per-view overrides; None means "use the setting". Checked when the
    view is decorated or its class defined, so a mistake fails at import,
    not on a client's request."""

    ttl: float | None = None
    lease: float | None = None
    wait: float | None = None
    required: bool = False
    scope: str | Callable[[Any], str | None] | None = None
    fingerprint: str | Callable[[Any], str] | None = None
    methods: Iterable[str] | None = None

    def __post_init__(self) -> None:
        for name in ("ttl", "lease", "wait"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _duration(name, value))
        if self.methods is not None:
            object.__setattr__(self, "methods", _methods(self.methods))
        given = {"ttl": self.ttl, "lease": self.lease, "wait": self.wait}
        problems = policy_problems(
            self.ttl if self.ttl is not None else 1.0,
            self.lease if self.lease is not None else (self.wait or 0.0) + 1.0,
            self.wait or 0.0,
        )
        if problems:
            shown = ", ".join(f"{k}={v:g}" for k, v in given.items() if v is not None)
            raise ImproperlyConfigured(f"Idempotency options {shown}: " + " ".join(problems))

    def covers(self, method: str, default: Iterable[str]) -> bool:
        method = method.upper()
        return method not in SAFE_METHODS and method in (self.methods or default)


# Every view's options as declared, by the view's module and name, for the
# system check that judges them against the settings (which may change after
# import) and for the OpenAPI schema of function views (DRF's @api_view
# names its view class after the function).
_declared: dict[tuple[str, str], Options] = {}


def declare(module: str, qualname: str, options: Options) -> Options:
    _declared[(module, qualname)] = options
    return options


def declared_options() -> list[tuple[str, Options]]:
    return [(f"{module}.{name}", options) for (module, name), options in _declared.items()]


def options_of_function_view(view_class: type) -> Options | None:
    """The options ``@idempotent`` declared for the function DRF's
    ``@api_view`` wrapped into ``view_class`` (which it names after the
    function), or None. An ``IdempotentMixin`` view answers for itself."""
    if hasattr(view_class, "get_idempotency_options"):
        return None
    return _declared.get((view_class.__module__, view_class.__name__))


def _duration(name: str, value: Any) -> float:
    if not is_duration(value):
        raise ImproperlyConfigured(
            f"The idempotency option {name}= must be a number of seconds or a timedelta, "
            f"not {value!r}."
        )
    return to_seconds(value)


def _methods(methods: Iterable[str]) -> frozenset[str]:
    if isinstance(methods, str) or not all(isinstance(m, str) and m for m in methods):
        raise ImproperlyConfigured(
            f"The idempotency option methods= must be a list of HTTP methods, not {methods!r}: "
            'write ["POST"], not "POST".'
        )
    upper = frozenset(m.upper() for m in methods)
    if upper & SAFE_METHODS:
        raise ImproperlyConfigured(
            f"The idempotency option methods= names {', '.join(sorted(upper & SAFE_METHODS))}: "
            "safe methods change nothing, so they never claim a key. Remove them."
        )
    return upper
