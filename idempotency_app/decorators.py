"""``@idempotent``: for DRF function views, APIView methods and viewset actions."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from rest_framework.request import Request
from rest_framework.views import APIView

from idempotency_app import drf

F = TypeVar("F", bound=Callable[..., Any])

# An explicitly decorated handler is idempotent for every unsafe method;
# ``methods=`` narrows it. Safe methods never claim a key.
DECORATOR_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def idempotent(
    func: F | None = None,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
    required: bool = False,
    scope: str | Callable[[Any], str | None] | None = None,
    fingerprint: str | Callable[[Any], str] | None = None,
    methods: Iterable[str] | None = None,
) -> Any:
    """Make a DRF handler safe to retry with an ``Idempotency-Key`` header.

    Use it under ``@api_view`` or on a view's ``post``/``patch``/action
    method, so DRF authenticates, checks permissions and throttles first.
    """
    options = drf.Options(
        ttl=ttl,
        lease=lease,
        wait=wait,
        required=required,
        scope=scope,
        fingerprint=fingerprint,
        methods=tuple(methods) if methods is not None else None,
    )

    def decorate(handler: F) -> F:
        @functools.wraps(handler)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            view, request = _locate(args)
            if not options.covers(request.method or "", DECORATOR_METHODS):
                return handler(*args, **kwargs)
            return drf.handle(view, request, lambda: handler(*args, **kwargs), options)

        wrapper.idempotency_options = options  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate(func) if func is not None else decorate


def _locate(args: tuple[Any, ...]) -> tuple[APIView, Request]:
    if args and isinstance(args[0], APIView):
        return args[0], args[1]
    request = args[0]
    if not isinstance(request, Request):
        raise TypeError(
            "@idempotent must decorate a DRF view: put it under @api_view, or on an APIView method."
        )
    return request.parser_context["view"], request
