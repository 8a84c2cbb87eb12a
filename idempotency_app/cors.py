"""Browser clients behind django-cors-headers: system checks that the
protocol's headers can cross origins.

A browser sends a custom request header cross-origin only when the preflight
answer allows it, and lets a script read a response header only when it is
exposed (``Retry-After`` is not CORS-safelisted either). Without these, a
browser client can neither send its key nor see that a response was a
replay, when to retry, or until when a retry replays. django-cors-headers
answers from its settings, so they can be judged at start-up.

Registered by ``IdempotencyConfig.ready()`` only when ``corsheaders`` is
installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from corsheaders.conf import conf as cors_conf
from django.core.checks import CheckMessage, Warning

from idempotency_app.conf import conf
from idempotency_app.drf import EXPIRES_HEADER, REPLAYED_HEADER

RETRY_AFTER = "Retry-After"
EXPOSED = (REPLAYED_HEADER, EXPIRES_HEADER, RETRY_AFTER)


def check_cors_headers(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    errors: list[CheckMessage] = []
    # "*" matches any header only for requests without credentials (Fetch).
    wildcard = not cors_conf.CORS_ALLOW_CREDENTIALS
    allowed = _lowered(cors_conf.CORS_ALLOW_HEADERS)
    header = conf.HEADER
    if allowed is not None and header.lower() not in allowed and not (wildcard and "*" in allowed):
        errors.append(
            Warning(
                f"CORS_ALLOW_HEADERS does not allow {header!r}: browsers on other origins "
                "cannot send an idempotency key.",
                hint="from corsheaders.defaults import default_headers; "
                f'CORS_ALLOW_HEADERS = (*default_headers, "{header.lower()}")',
                id="idempotency_app.W008",
            )
        )
    exposed = _lowered(cors_conf.CORS_EXPOSE_HEADERS)
    if exposed is not None and not (wildcard and "*" in exposed):
        missing = [name for name in EXPOSED if name.lower() not in exposed]
        if missing:
            listed = ", ".join(f'"{name}"' for name in missing)
            errors.append(
                Warning(
                    f"CORS_EXPOSE_HEADERS does not expose {', '.join(missing)}: scripts on other "
                    "origins cannot tell a replay, when to retry, or until when a retry replays.",
                    hint=f"Add them: CORS_EXPOSE_HEADERS = [..., {listed}]",
                    id="idempotency_app.W009",
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
