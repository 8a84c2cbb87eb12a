"""How async code runs under a claim. No HTTP here.

Django's async ORM has no transactions: every ``await Model.objects.acreate()``
is a synchronous query sent to a thread with ``sync_to_async(thread_sensitive=
True)``. Transactions live on a thread's connection. So the unit of work
(claim, ``transaction.atomic()``, the work, the completion) runs as *one*
synchronous call on that thread, the same thread Django's async ORM would
use (the request's, under ASGI), and the async work is driven from inside it
with ``async_to_sync``. The coroutine itself runs on the caller's event loop,
so its non-database awaits (HTTP calls, sleeps) stay asynchronous; its
database calls come back to the unit's thread, onto the connection that
holds the transaction, because asgiref sends thread-sensitive calls made
under an ``async_to_sync`` to the thread that called it.

The alternative, one ``sync_to_async`` hop per step with the transaction
left open between hops, fails three ways: the context variables the core
sets (the running claim, the work's refusals) would be reset from another
context than the one that set them; two coroutines of one request
(``asyncio.gather``) would interleave their statements on one connection,
inside one another's transactions; and a thread that is not Django's
request thread (a worker's ``asyncio.run``) has no such thread at all. The
figures behind the choice are in docs/async.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import async_to_sync, sync_to_async

P = ParamSpec("P")
T = TypeVar("T")


async def in_unit_thread(func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the synchronous ``func`` (a whole unit of work) on the thread
    Django's async ORM uses for this context, and await its result."""
    return await sync_to_async(func, thread_sensitive=True)(*args, **kwargs)


def blocking(
    coroutine_function: Callable[P, Coroutine[Any, Any, T]], *args: P.args, **kwargs: P.kwargs
) -> Callable[[], T]:
    """A synchronous call that runs the coroutine to its end; made inside a
    unit, the coroutine's database calls come back to the unit's thread."""
    return functools.partial(async_to_sync(coroutine_function), *args, **kwargs)


@asynccontextmanager
async def held_open(unit: Callable[[Callable[[], None]], object]) -> AsyncIterator[None]:
    """Run the caller's ``async with`` body inside a synchronous unit.

    ``unit(block)`` runs on the unit's thread and calls ``block()`` where the
    body belongs (inside its transaction); ``block`` returns when the body
    ends and raises what the body raised. The body runs with the unit's
    context: its thread-sensitive calls (the async ORM) go to the unit's
    thread, and the core's context variables (the running claim, the work's
    refusals) are those the unit set. After the body, whatever the unit
    raised (a result that cannot be stored, a lost claim) is raised here.
    """
    loop = asyncio.get_running_loop()
    entered: asyncio.Future[contextvars.Context] = loop.create_future()
    ended: asyncio.Future[None] = loop.create_future()

    async def body_runs() -> None:
        entered.set_result(contextvars.copy_context())
        await ended

    def wait() -> None:
        async_to_sync(body_runs)()

    finished = asyncio.ensure_future(in_unit_thread(unit, wait))
    try:
        await asyncio.wait((entered, finished), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # Cancelled while claiming: a unit that got as far as its block
        # must still end (release the claim, close its transaction).
        if entered.done():
            ended.set_exception(asyncio.CancelledError())
        else:
            entered.cancel()
        await _settled(finished)
        raise
    if not entered.done():
        # The unit ended before its block (a duplicate in progress, a reused
        # key, the database down): what it raised is the answer.
        entered.cancel()
        finished.result()
        raise RuntimeError("The unit of work returned without running its block.")
    tokens = _adopt(entered.result())
    try:
        yield
    except BaseException as exc:
        _restore(tokens)
        ended.set_exception(exc)
        await _settled(finished)
        error = None if finished.cancelled() else finished.exception()
        if error is not None and error is not exc:
            raise error from exc  # the unit's own verdict (a refused statement)
        raise
    _restore(tokens)
    ended.set_result(None)
    cancelled = await _settled(finished)
    finished.result()
    if cancelled:
        raise asyncio.CancelledError()


async def _settled(finished: asyncio.Future[Any]) -> bool:
    """Wait for the unit to finish (commit or roll back) even if this task
    is cancelled meanwhile: its thread must never be left holding a
    transaction. Whether a cancellation arrived; what the unit raised is
    read by the caller."""
    cancelled = False
    while not finished.done():
        try:
            await asyncio.shield(finished)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:
            break
    if not finished.cancelled():
        finished.exception()  # retrieved here: asyncio must not log it as lost
    return cancelled


def _adopt(context: contextvars.Context) -> list[tuple[contextvars.ContextVar[Any], Any]]:
    """Take the unit's context variables into the caller's context."""
    tokens: list[tuple[contextvars.ContextVar[Any], Any]] = []
    for var, value in context.items():
        if var.get(_MISSING) is not value:
            tokens.append((var, var.set(value)))
    return tokens


def _restore(tokens: list[tuple[contextvars.ContextVar[Any], Any]]) -> None:
    for var, token in reversed(tokens):
        var.reset(token)


_MISSING = object()
