"""The service API for async code.

``async with aonce(...)`` guards a block, ``@idempotent_task`` takes an
``async def`` as it is, and ``aclaim`` / ``acomplete`` / ``arelease`` /
``arenew`` / ``alookup`` / ``alookup_many`` are the by-hand calls. Each runs
its database work on the thread Django's async ORM uses for this context,
and a block's or task's unit of work (claim, transaction, completion) runs
there as one synchronous call with the coroutine driven inside it, so the
coroutine's ``await Model.objects.acreate(...)`` commits with the stored
result (see ``idempotency_app.aio``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from idempotency_app.lifecycle import aio
from idempotency_app.service.blocks import Run, once
from idempotency_app.service.lookups import Entry, lookup, lookup_many
from idempotency_app.service.manual import (
    Done,
    Held,
    claim,
    complete,
    complete_many,
    release,
    renew,
)
from idempotency_app.service.results import make_identity


@asynccontextmanager
async def aonce(
    scope: str,
    key: str | int,
    operation: str,
    fingerprint: Any = None,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
) -> AsyncIterator[Run]:
    """``once()`` for async code::

        async with aonce("provider:acme", event["id"], "payout") as run:
            if run.should_execute:
                payout = await Payout.objects.acreate(...)
                run.result = {"payout": payout.pk}

    The block's async ORM calls run in the transaction that stores
    ``run.result``: both commit, or neither. Everything else is as in
    ``once()``: a duplicate of completed work reads the stored result, one of
    work in progress raises ``KeyInProgress`` before the block.
    """
    make_identity(scope, key, operation, fingerprint)  # a bad key fails before any thread hop
    opened: list[Run] = []

    def unit(block: Any) -> None:
        with once(scope, key, operation, fingerprint, ttl=ttl, lease=lease, wait=wait) as run:
            opened.append(run)
            block()

    async with aio.held_open(unit):
        yield opened[0]


async def aclaim(
    scope: str,
    key: str | int,
    operation: str,
    fingerprint: Any = None,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
) -> Held | Done:
    """``claim()``; outside a transaction the claim commits at once."""
    return await aio.in_unit_thread(
        claim, scope, key, operation, fingerprint, ttl=ttl, lease=lease, wait=wait
    )


async def acomplete(held: Held, result: Any = None) -> Any:
    """``complete()``. Inside an ``aonce()`` block or an idempotent async
    view it joins that unit's transaction; elsewhere it commits on its own,
    so work that must commit with it belongs in ``aonce()`` instead."""
    return await aio.in_unit_thread(complete, held, result)


async def acomplete_many(items: Iterable[tuple[Held, Any]]) -> list[Any]:
    return await aio.in_unit_thread(complete_many, list(items))


async def arelease(held: Held) -> bool:
    return await aio.in_unit_thread(release, held)


async def arenew(held: Held, lease: float | None = None) -> bool:
    return await aio.in_unit_thread(renew, held, lease)


async def alookup(scope: str, key: str | int) -> Entry | None:
    return await aio.in_unit_thread(lookup, scope, key)


async def alookup_many(scope: str, keys_: Iterable[str | int]) -> dict[str, Entry]:
    return await aio.in_unit_thread(lookup_many, scope, list(keys_))
