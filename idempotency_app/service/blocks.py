"""``once()``: a block of code that runs once per (scope, key)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from idempotency_app import signals
from idempotency_app.conf import conf
from idempotency_app.lifecycle import aio, units
from idempotency_app.lifecycle.claims import AtomicClaim, Claim, Policy, derive_key
from idempotency_app.service.manual import Done, Held, decide, renew
from idempotency_app.service.results import (
    TASK_STATUS,
    decode,
    encode,
    make_identity,
    stored_result,
)
from idempotency_app.store import Identity


class Run:
    """What ``once()`` hands the block: run the work only if
    ``should_execute``, and set ``result``; on a duplicate, ``replayed`` is
    True and ``result`` holds the stored result."""

    def __init__(self, identity: Identity, held: Held | None, result: Any = None) -> None:
        self.identity = identity
        self.held = held
        self._result = result

    @property
    def should_execute(self) -> bool:
        return self.held is not None

    @property
    def replayed(self) -> bool:
        return self.held is None

    @property
    def result(self) -> Any:
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self.held is None:
            raise RuntimeError(
                "This run was replayed: its result is the stored one. Check "
                "run.should_execute before doing the work."
            )
        self._result = value

    def derive_key(self, label: str) -> str:
        return derive_key(self.identity.scope, self.identity.key, label)

    def renew(self, lease: float | None = None) -> bool:
        if self.held is None:
            raise RuntimeError("Only a run that executes holds a lease.")
        return renew(self.held, lease)

    async def arenew(self, lease: float | None = None) -> bool:
        """``renew()`` from an ``aonce()`` block."""
        return await aio.in_unit_thread(self.renew, lease)


@contextlib.contextmanager
def once(
    scope: str,
    key: str | int,
    operation: str,
    fingerprint: Any = None,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
) -> Iterator[Run]:
    """Run a block once per (scope, key)::

        with once("provider:acme", event["id"], "payout") as run:
            if run.should_execute:
                run.result = pay(event)
        return run.result

    The block runs in a transaction that also stores ``run.result``: both
    commit, or neither (an exception releases the claim and propagates).
    After the block, ``run.result`` is the stored form for every copy.
    A duplicate of a completed key skips the work and reads the stored
    result; of a key in progress, raises ``KeyInProgress`` before the block.
    """
    identity = make_identity(scope, key, operation, fingerprint)
    policy = Policy.from_settings(ttl, lease, wait)
    running = units.running(identity, policy.using)
    if running is not None:
        # Inside work already running for this key: part of that run, which
        # stores the result. Its claim is handed over, so renew() renews it.
        yield Run(identity, dataclasses.replace(running, policy=policy))
        return
    if not conf.ENABLED:
        yield Run(identity, AtomicClaim(identity, "", policy))
        return
    with units.claimed(identity, policy) as decision:
        held = decide(decision)
        if isinstance(held, Done):
            yield Run(identity, None, held.result)
            return
        run = Run(identity, held)
        with units.unit_of_work(held) as unit:
            yield run
            stored = stored_result(encode(run.result))
            unit.finish(run.result, stored)
    unit.outcome()  # raises WorkRolledBack or ClaimLost when nothing was stored
    signals.executed.send(Claim, identity=identity, status=TASK_STATUS)
    run._result = decode(stored)
