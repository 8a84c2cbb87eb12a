"""``@idempotent_task``: a function that runs once per key."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, ParamSpec, cast

from asgiref.sync import iscoroutinefunction

from idempotency_app import signals
from idempotency_app.conf import conf
from idempotency_app.lifecycle import aio, units
from idempotency_app.lifecycle.claims import Claim, Policy, Replay
from idempotency_app.lifecycle.units import refuse_generator
from idempotency_app.service.results import (
    TASK_STATUS,
    decode,
    encode,
    make_identity,
    stored_result,
)
from idempotency_app.store import Identity

P = ParamSpec("P")


def idempotent_task(
    *,
    key: Callable[..., str | int],
    scope: str | Callable[..., str],
    operation: str | None = None,
    fingerprint: Callable[..., Any] | None = None,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
) -> Callable[[Callable[P, Any]], Callable[P, Any]]:
    """Run the decorated function once per key; duplicates get its stored result.

    ``key``, ``scope`` (when callable) and ``fingerprint`` receive the
    function's own arguments: ``key=lambda event: event["id"]``. The
    operation defaults to the function's dotted name. The function's work and
    its stored result commit together. Every caller, the first included,
    gets the result as JSON decodes it.

    An ``async def`` function stays one: awaiting the wrapper runs the unit
    on the thread Django's async ORM uses, with the coroutine inside it, so
    its ``await Model.objects.acreate(...)`` commits with the result. A
    generator is refused (``TypeError``) when decorated.
    """

    def decorate(func: Callable[P, Any]) -> Callable[P, Any]:
        name = operation or f"{func.__module__}.{func.__qualname__}"[-255:]
        refuse_generator(func, "@idempotent_task")

        def identify(*args: Any, **kwargs: Any) -> Identity:
            where = scope(*args, **kwargs) if callable(scope) else scope
            facts = None if fingerprint is None else fingerprint(*args, **kwargs)
            return make_identity(where, key(*args, **kwargs), name, facts)

        def settle(identity: Identity, call: Callable[[], Any]) -> Any:
            policy = Policy.from_settings(ttl, lease, wait)
            outcome = units.run(identity, lambda: encode(call()), stored_result, policy)
            if isinstance(outcome, Replay):
                return decode(outcome.response)
            signals.executed.send(Claim, identity=identity, status=TASK_STATUS)
            return json.loads(outcome.value)

        wrapper: Callable[P, Any]
        if iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                identity = identify(*args, **kwargs)
                if not conf.ENABLED:
                    return await func(*args, **kwargs)
                # The whole unit on the thread Django's async ORM uses; the
                # coroutine runs inside it (see idempotency_app.aio).
                return await aio.in_unit_thread(
                    settle, identity, aio.blocking(func, *args, **kwargs)
                )

            wrapper = async_wrapper
        else:

            @functools.wraps(func)
            def sync_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                identity = identify(*args, **kwargs)
                if not conf.ENABLED:
                    return func(*args, **kwargs)
                return settle(identity, functools.partial(func, *args, **kwargs))

            wrapper = sync_wrapper

        cast(Any, wrapper).identify = identify
        return wrapper

    return decorate
