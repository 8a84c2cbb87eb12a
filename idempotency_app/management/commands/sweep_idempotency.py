"""Delete expired idempotency records and claims abandoned long ago.

Safe to run from cron while traffic flows: see ``idempotency_app.sweep`` for
how each batch decides, in its own short transaction, what to delete.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.db.models import Q

from idempotency_app import clock
from idempotency_app.conf import conf
from idempotency_app.sweep import DEFAULT_BATCH, batches, expired, stale

MIN_BATCH = 1
MAX_BATCH = 100_000


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
        total = 0
        if budget.exhausted():
            return total
        for batch, count in enumerate(batches(condition, batch_size, using, self.dry_run), 1):
            budget.spend()
            total += count
            if self.verbosity >= 2:
                verb = "would delete" if self.dry_run else "deleted"
                self.stdout.write(f"Batch {batch}: {verb} {count} {what} ({total} so far).")
            if budget.exhausted():
                break
        return total
