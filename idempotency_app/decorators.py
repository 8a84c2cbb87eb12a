"""``@idempotent``: for DRF function views, APIView methods and viewset actions."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction
from rest_framework.request import Request
from rest_framework.views import APIView

from idempotency_app.http import async_handling, handling
from idempotency_app.http.keys import http_request
from idempotency_app.http.options import Options, declare
from idempotency_app.lifecycle.units import refuse_generator

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
    An ``async def`` handler of an adrf view is covered the same way; a
    generator is refused when decorated.
    """
    options = Options(
        ttl=ttl,
        lease=lease,
        wait=wait,
        required=required,
        scope=scope,
        fingerprint=fingerprint,
        methods=methods,
    )

    def decorate(handler: F) -> F:
        declare(handler.__module__, handler.__qualname__, options)
        _refuse_unsupported(handler)
        if iscoroutinefunction(handler):  # an adrf async view
            wrapped = async_handling.decorated(handler, options, _locate, DECORATOR_METHODS)
            wrapped.idempotency_options = options  # type: ignore[attr-defined]
            return cast(F, wrapped)

        @functools.wraps(handler)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            view, request = _locate(args)
            if not options.covers(http_request(request).method or "", DECORATOR_METHODS):
                return handler(*args, **kwargs)
            return handling.handle(view, request, lambda: handler(*args, **kwargs), options)

        wrapper.idempotency_options = options  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate(func) if func is not None else decorate


def _refuse_unsupported(handler: Callable[..., Any]) -> None:
    """What no claim could cover is refused here, not with a 500 later."""
    refuse_generator(handler, "@idempotent")
    if isinstance(getattr(handler, "cls", None), type) or hasattr(handler, "view_class"):
        raise TypeError(
            f"@idempotent was put above @api_view (or on as_view()) for {handler.__qualname__}: "
            "it must decorate the handler itself, so DRF authenticates and checks permissions "
            "first. Put @idempotent directly above the function, under @api_view."
        )


def _locate(args: tuple[Any, ...]) -> tuple[APIView, Request]:
    if args and isinstance(args[0], APIView):
        return args[0], args[1]
    request = args[0]
    if not isinstance(request, Request):
        raise TypeError(
            "@idempotent must decorate a DRF view: put it under @api_view, or on an APIView method."
        )
    return request.parser_context["view"], request
