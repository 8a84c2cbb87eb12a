from __future__ import annotations

import sys
from argparse import ArgumentParser
from typing import Any, TextIO

from django.core.management.base import BaseCommand, CommandError

from example_project.payments.webhooks import PROVIDERS, parse_event, process_event, scope_for
from idempotency_app import service


class Command(BaseCommand):
    help = (
        "Process a JSON-lines file of provider events exactly once each: events "
        "already processed (by this command or the webhook) are skipped."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("path", help="A file with one JSON event per line, or - for stdin.")
        parser.add_argument("--provider", default="acme", choices=sorted(PROVIDERS))

    def handle(self, *args: Any, **options: Any) -> None:
        provider: str = options["provider"]
        verbosity: int = options["verbosity"]
        path: str = options["path"]
        try:
            if path == "-":
                events = read_events(sys.stdin)
            else:
                with open(path, encoding="utf-8") as lines:
                    events = read_events(lines)
        except OSError as exc:
            raise CommandError(f"Cannot read {path}: {exc.strerror}.") from exc
        except UnicodeDecodeError as exc:
            raise CommandError(f"{path} is not UTF-8 text ({exc.reason}).") from exc
        # One query tells which events are done; the claim in process_event
        # stays the arbiter for the rest (another worker may be on them).
        done = service.lookup_many(scope_for(provider), events)
        processed = skipped = busy = reused = 0
        for event_id, event in events.items():
            entry = done.get(event_id)
            if entry is not None and entry.completed:
                skipped += 1
                continue
            try:
                result = process_event(provider, event)
            except service.KeyInProgress:
                busy += 1
                self.stderr.write(f"{event_id}: in progress elsewhere")
                continue
            except service.KeyReused:
                reused += 1
                self.stderr.write(f"{event_id}: already processed with different contents")
                continue
            processed += 1
            if verbosity >= 2:
                self.stdout.write(f"{event_id}: {result['status']}")
        if verbosity >= 1:
            self.stdout.write(
                f"{processed} processed, {skipped} already processed, "
                f"{busy} in progress elsewhere, {reused} conflicting."
            )
        if busy:
            raise CommandError(
                f"{busy} events are in progress elsewhere; run the batch again later."
            )
        if reused:
            raise CommandError(f"{reused} events reuse a processed id with different contents.")


def read_events(lines: TextIO) -> dict[str, dict[str, Any]]:
    """Events by id, in file order; a repeated id is one event."""
    events: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        event = parse_event(line)
        if event is None:
            raise CommandError(f"Line {number}: expected a JSON event with a string id.")
        events.setdefault(event["id"], event)
    return events
