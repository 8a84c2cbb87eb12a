"""The system check on where idempotent handlers are served.

``@idempotent`` needs DRF (or adrf) around it: authentication, permissions
and throttling first, then a DRF ``Request``. A decorated function that the
URLconf serves as a plain Django view, sync or async, would fail on every
covered request; this check refuses it at start-up instead, naming the view.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.views import APIView


@register(Tags.urls)
def check_idempotent_views(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[CheckMessage]:
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
            Error(
                f"{name} (route {route!r}) is decorated with @idempotent but served as a plain "
                "Django view, without DRF: every covered request would fail.",
                hint="Put @api_view([...]) above @idempotent (adrf.decorators.api_view for an "
                "async view), or base the class on DRF's or adrf's APIView. For a view that "
                "must stay plain Django, use idempotency_app.service.once() (or aonce()) inside it.",
                obj=callback,
                id="idempotency_app.E030",
            )
        )
    return errors


def _callbacks(patterns: Sequence[Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _callbacks(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern), pattern.callback
