"""Delete expired idempotency records and claims abandoned long ago.

Safe to run from cron while traffic flows: see ``idempotency_app.sweep`` for
how each batch decides, in its own short transaction, what to delete.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from idempotency_app.conf import conf
from idempotency_app.sweep import DEFAULT_BATCH, batches, remains

MIN_BATCH = 1
MAX_BATCH = 100_000


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
            help="Stop each pass (expired records, stale claims) after this many batches "
            "(default: until nothing is left). Stopping with rows left is an error (exit "
            "status 1), so a scheduler learns that the sweep falls behind.",
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
        started = time.monotonic()
        n_expired, more_expired = self._sweep(
            "expired records", "expired", batch_size, using, max_batches
        )
        n_stale, more_stale = self._sweep(
            "stale claims", "stale", batch_size, using, max_batches, grace
        )
        if verbosity >= 1:
            verb = "Would delete" if dry_run else "Deleted"
            self.stdout.write(
                f"{verb} {n_expired} expired records and {n_stale} stale claims "
                f"in {time.monotonic() - started:.2f} s."
            )
        left = [
            what
            for what, more in (("expired records", more_expired), ("stale claims", more_stale))
            if more
        ]
        if left:
            raise CommandError(
                f"More {' and '.join(left)} remain: --max-batches {max_batches} stopped the "
                "sweep. Run it again, raise --max-batches or --batch-size, or sweep more often."
            )

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

    def _sweep(
        self,
        what: str,
        kind: str,
        batch_size: int,
        using: str,
        max_batches: int | None,
        grace: float = 0,
    ) -> tuple[int, bool]:
        """One pass; how many rows it deleted, and whether it stopped at
        ``max_batches`` with rows left. A run looks once, by the condition's
        index, for a row that still matches (one that came to match while it
        ran is a backlog too); a dry run, which deleted nothing, reads one
        batch further."""
        total = 0
        pending = batches(kind, batch_size, using, self.dry_run, grace)
        for batch, count in enumerate(pending, 1):
            total += count
            if self.verbosity >= 2:
                verb = "would delete" if self.dry_run else "deleted"
                self.stdout.write(f"Batch {batch}: {verb} {count} {what} ({total} so far).")
            if batch == max_batches:
                if self.dry_run:
                    return total, next(pending, 0) > 0
                return total, remains(kind, using, grace)
        return total, False
