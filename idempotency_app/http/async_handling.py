"""Async DRF views (adrf's ``APIView``, ``ViewSet`` and ``api_view``) under
the idempotency lifecycle.

adrf runs ``initial()`` (authentication, permissions, throttling) first and
then awaits the handler. Covered, the handler runs inside the same unit of
work as a sync view's, ``handling.handle``: identification, the claim, the
transaction, the completion and the replay are the sync code, run as one
call on the thread Django's async ORM uses for the request, with the
handler's coroutine driven inside it (``idempotency_app.aio``). So the
handler's ``await Model.objects.acreate(...)`` commits with the stored
response, and every answer (409, 422, 406, replays and their headers) is
the sync one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from django.http import HttpResponseBase
from rest_framework.request import Request
from rest_framework.views import APIView

from idempotency_app.conf import conf
from idempotency_app.http import handling
from idempotency_app.http.options import Options
from idempotency_app.lifecycle import aio

Handler = Callable[..., Coroutine[Any, Any, Any]]


async def handle(
    view: APIView,
    request: Request,
    call: Callable[[], Coroutine[Any, Any, Any]],
    options: Options,
) -> HttpResponseBase:
    """``handling.handle`` for a coroutine handler."""
    if not conf.ENABLED or (request.headers.get(conf.HEADER) is None and not options.required):
        response: HttpResponseBase = await call()  # nothing to claim: no thread hop
        return response
    return await aio.in_unit_thread(handling.handle, view, request, aio.blocking(call), options)


def decorated(
    handler: Handler,
    options: Options,
    locate: Callable[[tuple[Any, ...]], tuple[APIView, Request]],
    methods: Iterable[str],
) -> Handler:
    """``@idempotent`` on an ``async def`` handler: the wrapper stays a
    coroutine function, so Django and adrf still see an async view."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        view, request = locate(args)
        call = functools.partial(handler, *args, **kwargs)
        if not options.covers(request.method or "", methods):
            return await call()
        return await handle(view, request, call, options)

    return wrapper


def covered(view: APIView, handler: Handler, options: Options) -> Handler:
    """``IdempotentMixin``'s stand-in for one request's async handler."""

    @functools.wraps(handler)
    async def idempotent_handler(request: Request, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(handler, request, *args, **kwargs)
        return await handle(view, request, call, options)

    return idempotent_handler
