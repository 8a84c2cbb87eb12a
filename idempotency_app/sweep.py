"""Deleting what the table no longer needs: records past their expiry and
in-progress claims abandoned long ago.

``manage.py sweep_idempotency`` runs it to the end; ``AUTO_SWEEP_INTERVAL``
runs one bounded round after a request, at most once per interval across
all processes.

Each batch is one short transaction: select up to ``batch_size`` primary keys
in pk order after the previous batch (keyset, so no row is visited twice and
memory stays flat), then delete that pk range with the same condition
repeated in one DELETE statement. A record re-claimed or completed between
the two statements no longer matches and is kept. The DELETE never goes
through Django's collector, which (when any ``pre_delete``/``post_delete``
receiver exists) would select the rows, bodies included, and delete them by
primary key alone, dropping the condition. Every condition is judged by the
database's clock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.db import connections, transaction

from idempotency_app import clock, service, store
from idempotency_app.conf import conf

logger = logging.getLogger("idempotency_app")

DEFAULT_BATCH = 5000
# The automatic sweep's own record: its key names the interval, so the unique
# constraint lets one process per interval sweep, whatever the process count.
AUTO_SWEEP_SCOPE = "idempotency_app"
AUTO_SWEEP_OPERATION = "idempotency_app.sweep"


def batches(
    kind: str, batch_size: int, using: str, dry_run: bool = False, grace: float = 0
) -> Iterator[int]:
    """Delete the ``kind`` records ("expired": past their window and not
    held by a live lease; "stale": in-progress claims inside their window
    whose lease lapsed more than ``grace`` seconds ago) a batch at a time,
    yielding each batch's count; stop iterating to stop deleting.
    ``dry_run`` counts what would go and deletes nothing."""
    records = store.backend(using)
    after: int | None = None
    while True:
        with transaction.atomic(using=using):
            pks = records.sweep_batch(kind, after, batch_size, grace)
            if not pks:
                return
            after = pks[-1]
            count = len(pks) if dry_run else records.sweep_delete(kind, pks[0], after, grace)
        yield count
        if len(pks) < batch_size:
            return


def remains(kind: str, using: str, grace: float = 0) -> bool:
    """Whether a ``kind`` record is left to sweep."""
    return bool(store.backend(using).sweep_batch(kind, None, 1, grace))


# Seconds since the epoch before which this process will not try again.
_next_attempt = 0.0


def sweep_after_request(**kwargs: Any) -> None:
    """``request_finished`` receiver: the response has gone out, so a due
    sweep costs this worker a moment before its next request, not a client.
    Nothing here may raise into the server: a failure (even a malformed
    setting) is logged and left for the next interval."""
    global _next_attempt
    try:
        interval = conf.AUTO_SWEEP_INTERVAL
        if interval <= 0 or not conf.ENABLED:
            return
        connection = connections[conf.DATABASE_ALIAS]
        if connection.in_atomic_block:
            # Someone's transaction is still open (a test wrapping requests
            # in one, say): a round there would commit or roll back with it.
            return
        now = clock.now()
        seconds = now.timestamp()
        # A clock stepped back by more than an interval does not stall us.
        if seconds < _next_attempt <= seconds + interval:
            return
        _next_attempt = seconds + interval
        try:
            auto_sweep(now, interval)
        finally:
            # Django closed the request's connections before this receiver
            # ran; close ours the same way rather than leave it idle.
            connection.close_if_unusable_or_obsolete()
    except Exception as exc:
        logger.warning("The automatic idempotency sweep failed; it will try again: %s", exc)


def auto_sweep(now: datetime, interval: float) -> dict[str, int] | None:
    """One bounded round (a batch of expired records, a batch of stale
    claims), unless another process already took this interval's round.
    Returns what was deleted, or None when it was not this process's turn."""
    window = int(now.timestamp() // interval)
    try:
        held = service.claim(
            AUTO_SWEEP_SCOPE, f"sweep:{window}", AUTO_SWEEP_OPERATION, ttl=interval, wait=0
        )
    except service.KeyInProgress:
        return None
    if isinstance(held, service.Done):
        return None
    using = conf.DATABASE_ALIAS
    try:
        deleted = {
            "expired": next(batches("expired", DEFAULT_BATCH, using), 0),
            "stale": next(batches("stale", DEFAULT_BATCH, using, grace=conf.LEASE), 0),
        }
        service.complete(held, deleted)
    except BaseException:
        held.let_go()
        raise
    if DEFAULT_BATCH in deleted.values():
        logger.warning(
            "The automatic idempotency sweep deleted a full batch and more may remain: "
            "shorten AUTO_SWEEP_INTERVAL or schedule manage.py sweep_idempotency."
        )
    else:
        logger.info("The automatic idempotency sweep deleted %s.", deleted)
    return deleted
