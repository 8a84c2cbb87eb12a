"""Delete expired idempotency records and claims abandoned long ago.

Safe to run from cron while traffic flows. Each batch is one short
transaction: select up to ``--batch-size`` primary keys in pk order after the
previous batch (keyset, so no row is visited twice and memory stays flat),
then delete that pk range with the same condition repeated in the DELETE. A
record re-claimed or completed between the two statements no longer matches
and is kept. The condition is judged against one instant taken at the start,
so a run that lasts minutes never deletes more than it would have at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections, transaction
from django.db.models import Q

from idempotency_app import clock
from idempotency_app.conf import conf
from idempotency_app.models import IdempotencyRecord

MIN_BATCH = 1
MAX_BATCH = 100_000
DEFAULT_BATCH = 5000


def expired(now: datetime) -> Q:
    """Past its replay window, and not held by a live lease (a claim whose
    lease was renewed beyond its expiry is still someone's)."""
    return Q(expires_at__lte=now) & (Q(locked_until__isnull=True) | Q(locked_until__lte=now))


def stale(now: datetime, grace: float) -> Q:
    """An in-progress claim inside its window whose lease lapsed more than
    ``grace`` seconds ago: its worker is gone, a retry would take it over."""
    return Q(
        status=IdempotencyRecord.Status.IN_PROGRESS,
        locked_until__lte=now - timedelta(seconds=grace),
        expires_at__gt=now,
    )


@dataclass
class Budget:
    """Batches ``--max-batches`` leaves for the whole run; None: no limit."""

    left: int | None

    def exhausted(self) -> bool:
        return self.left is not None and self.left <= 0

    def spend(self) -> None:
        if self.left is not None:
            self.left -= 1


class Command(BaseCommand):
    help = (
        "Delete idempotency records past their expiry and in-progress claims whose lease "
        "lapsed longer ago than --stale-after, in short batches. Safe to run while serving."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=int,
            default=DEFAULT_BATCH,
            help=f"Rows per batch, {MIN_BATCH} to {MAX_BATCH} (default {DEFAULT_BATCH}).",
        )
        parser.add_argument(
            "--stale-after",
            type=float,
            default=None,
            metavar="SECONDS",
            help="Delete in-progress claims whose lease lapsed at least this long ago "
            "(default and minimum: the LEASE setting).",
        )
        parser.add_argument(
            "--max-batches",
            type=int,
            default=None,
            help="Stop after this many batches (default: until nothing is left).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count what would be deleted; delete nothing."
        )
        parser.add_argument(
            "--database",
            default=None,
            help="Database alias (default: IDEMPOTENCY['DATABASE_ALIAS']).",
        )

    def handle(
        self,
        *args: Any,
        batch_size: int,
        stale_after: float | None,
        max_batches: int | None,
        dry_run: bool,
        database: str | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        using = database or conf.DATABASE_ALIAS
        grace = self._validate(batch_size, stale_after, max_batches, using)
        self.verbosity = verbosity
        self.dry_run = dry_run
        now = clock.now()
        budget = Budget(max_batches)
        n_expired = self._sweep("expired records", expired(now), batch_size, using, budget)
        n_stale = self._sweep("stale claims", stale(now, grace), batch_size, using, budget)
        if verbosity >= 1:
            verb = "Would delete" if dry_run else "Deleted"
            self.stdout.write(f"{verb} {n_expired} expired records and {n_stale} stale claims.")

    def _validate(
        self, batch_size: int, stale_after: float | None, max_batches: int | None, using: str
    ) -> float:
        if not MIN_BATCH <= batch_size <= MAX_BATCH:
            raise CommandError(
                f"--batch-size must be from {MIN_BATCH} to {MAX_BATCH}, not {batch_size}."
            )
        if max_batches is not None and max_batches < 1:
            raise CommandError(f"--max-batches must be at least 1, not {max_batches}.")
        if using not in connections.settings:
            raise CommandError(
                f"Unknown database {using!r}; use one of: {', '.join(connections.settings)}."
            )
        lease = conf.LEASE
        if stale_after is None:
            return lease
        if stale_after < lease:
            raise CommandError(
                f"--stale-after must be at least LEASE ({lease:g}s), not {stale_after:g}: "
                "a shorter age could delete a claim that a request still holds."
            )
        return stale_after

    def _sweep(self, what: str, condition: Q, batch_size: int, using: str, budget: Budget) -> int:
        records = IdempotencyRecord.objects.using(using)
        total = 0
        batch = 0
        after: int | None = None
        while not budget.exhausted():
            with transaction.atomic(using=using):
                candidates = records.filter(condition)
                if after is not None:
                    candidates = candidates.filter(pk__gt=after)
                pks = list(candidates.order_by("pk").values_list("pk", flat=True)[:batch_size])
                if not pks:
                    break
                after = pks[-1]
                if self.dry_run:
                    count = len(pks)
                else:
                    count, _ = records.filter(condition, pk__gte=pks[0], pk__lte=after).delete()
            budget.spend()
            total += count
            batch += 1
            if self.verbosity >= 2:
                verb = "would delete" if self.dry_run else "deleted"
                self.stdout.write(f"Batch {batch}: {verb} {count} {what} ({total} so far).")
            if len(pks) < batch_size:
                break
        return total
