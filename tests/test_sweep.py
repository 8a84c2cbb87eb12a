"""sweep_idempotency against real rows: what goes, what stays, and the options."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.models.signals import pre_delete

from idempotency_app import clock
from idempotency_app.models import IdempotencyRecord

pytestmark = pytest.mark.django_db

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)
LEASE = 60  # the default setting
# The sweep runs a millisecond after NOW: SQLite's clock counts whole
# milliseconds, so within the first one after freeze() it can read just
# under NOW and keep a record that expires at NOW exactly.
SWEPT_AT = NOW + timedelta(milliseconds=1)
IN_PROGRESS = IdempotencyRecord.Status.IN_PROGRESS
COMPLETED = IdempotencyRecord.Status.COMPLETED


def make(
    key: str,
    status: str = COMPLETED,
    expires_in: float = 3600,
    lease_left: float | None = None,
) -> IdempotencyRecord:
    """A record seen from NOW: ``expires_in`` and ``lease_left`` are seconds
    from NOW (negative: in the past)."""
    in_progress = status == IN_PROGRESS
    return IdempotencyRecord.objects.create(
        scope="user:1",
        key=key,
        operation="POST charges/",
        fingerprint="f" * 64,
        status=status,
        token="t" * 32,
        created_at=NOW - timedelta(seconds=100),
        expires_at=NOW + timedelta(seconds=expires_in),
        locked_until=None if lease_left is None else NOW + timedelta(seconds=lease_left),
        response_status=None if in_progress else 201,
        response_headers="" if in_progress else '[["Content-Type", "application/json"]]',
        response_body=None if in_progress else b'{"id": 1}',
    )


def sweep(*args: str, **options: Any) -> str:
    """The command's output, its duration left out."""
    out = StringIO()
    with clock.freeze(SWEPT_AT):
        call_command("sweep_idempotency", *args, stdout=out, stderr=StringIO(), **options)
    return re.sub(r" in \d+\.\d\d s\.$", ".", out.getvalue(), flags=re.MULTILINE)


def keys() -> set[str]:
    return set(IdempotencyRecord.objects.values_list("key", flat=True))


@pytest.fixture
def mixed() -> None:
    make("expired-completed", expires_in=-1)
    make("expired-at-this-instant", expires_in=0)
    make("expired-claim", IN_PROGRESS, expires_in=-10, lease_left=-500)
    make("live-completed", expires_in=1)
    make("stale-claim", IN_PROGRESS, lease_left=-LEASE - 1)
    make("lapsed-within-grace", IN_PROGRESS, lease_left=-LEASE + 5)
    make("live-claim", IN_PROGRESS, lease_left=30)
    # Lease renewed beyond the replay window: a worker still holds it.
    make("renewed-past-expiry", IN_PROGRESS, expires_in=-10, lease_left=30)


def test_deletes_expired_and_stale_only(mixed: None) -> None:
    output = sweep()
    assert output == "Deleted 3 expired records and 1 stale claims.\n"
    assert keys() == {"live-completed", "lapsed-within-grace", "live-claim", "renewed-past-expiry"}


def test_second_run_finds_nothing(mixed: None) -> None:
    sweep()
    assert sweep() == "Deleted 0 expired records and 0 stale claims.\n"
    assert len(keys()) == 4


def test_dry_run_counts_and_keeps_everything(mixed: None) -> None:
    output = sweep("--dry-run")
    assert output == "Would delete 3 expired records and 1 stale claims.\n"
    assert len(keys()) == 8


def test_stale_after_widens_the_grace(mixed: None) -> None:
    make("lapsed-long-ago", IN_PROGRESS, lease_left=-1000)
    output = sweep("--stale-after", "600")
    assert output.endswith("and 1 stale claims.\n")
    assert "stale-claim" in keys()
    assert "lapsed-long-ago" not in keys()


def test_grace_follows_the_lease_setting(settings: Any) -> None:
    settings.IDEMPOTENCY = {"LEASE": 300}
    make("lapsed-200s-ago", IN_PROGRESS, lease_left=-200)
    make("lapsed-400s-ago", IN_PROGRESS, lease_left=-400)
    assert sweep() == "Deleted 0 expired records and 1 stale claims.\n"
    assert keys() == {"lapsed-200s-ago"}


def test_batches_walk_interleaved_rows(settings: Any) -> None:
    for i in range(23):
        make(f"expired-{i}", expires_in=-1)
        make(f"live-{i}", expires_in=60)
    output = sweep("--batch-size", "5", verbosity=2)
    lines = output.splitlines()
    assert lines[0] == "Batch 1: deleted 5 expired records (5 so far)."
    assert lines[4] == "Batch 5: deleted 3 expired records (23 so far)."
    assert lines[-1] == "Deleted 23 expired records and 0 stale claims."
    assert len(lines) == 6
    assert keys() == {f"live-{i}" for i in range(23)}


def test_dry_run_progress_says_would(settings: Any) -> None:
    for i in range(3):
        make(f"expired-{i}", expires_in=-1)
    output = sweep("--dry-run", "--batch-size", "2", verbosity=2)
    assert output.splitlines() == [
        "Batch 1: would delete 2 expired records (2 so far).",
        "Batch 2: would delete 1 expired records (3 so far).",
        "Would delete 3 expired records and 0 stale claims.",
    ]


def test_max_batches_bounds_each_pass_and_says_when_more_remain(settings: Any) -> None:
    """A backlog left by --max-batches is an error (exit status 1), so cron
    with -v 0 learns that the sweep falls behind; stale claims get their own
    batches, never skipped because expired records used them all."""
    for i in range(7):
        make(f"expired-{i}", expires_in=-1)
    for i in range(7):
        make(f"stale-{i}", IN_PROGRESS, lease_left=-1000)
    with pytest.raises(CommandError, match="More expired records and stale claims remain"):
        sweep("--batch-size", "3", "--max-batches", "2", verbosity=0)
    assert len(keys()) == 2, "6 of each deleted, one of each left"
    assert sweep("--batch-size", "3", "--max-batches", "2") == (
        "Deleted 1 expired records and 1 stale claims.\n"
    )
    assert keys() == set()


def test_a_run_that_finishes_within_max_batches_is_no_error(settings: Any) -> None:
    for i in range(6):
        make(f"expired-{i}", expires_in=-1)
    assert sweep("--batch-size", "3", "--max-batches", "2") == (
        "Deleted 6 expired records and 0 stale claims.\n"
    )


def test_a_dry_run_ending_on_a_full_batch_reports_no_backlog(settings: Any) -> None:
    for i in range(6):
        make(f"expired-{i}", expires_in=-1)
    assert sweep("--dry-run", "--batch-size", "3", "--max-batches", "2") == (
        "Would delete 6 expired records and 0 stale claims.\n"
    )
    make("expired-6", expires_in=-1)
    with pytest.raises(CommandError, match="More expired records remain"):
        sweep("--dry-run", "--batch-size", "3", "--max-batches", "2", verbosity=0)
    assert len(keys()) == 7, "a dry run deletes nothing"


def test_a_batch_shortened_by_a_takeover_still_reports_the_backlog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry takes over a stale claim between the batch's SELECT and its
    DELETE: the batch deletes fewer rows than it selected, yet more remain."""
    from idempotency_app import store

    for i in range(10):
        make(f"stale-{i}", IN_PROGRESS, lease_left=-1000)
    records = store.backend("default")
    real = records.sweep_delete

    def after_a_takeover(kind: str, first: int, last: int, grace: float = 0) -> int:
        IdempotencyRecord.objects.filter(pk=first).update(status="completed")
        return real(kind, first, last, grace)

    monkeypatch.setattr(records, "sweep_delete", after_a_takeover)
    with pytest.raises(CommandError, match="More stale claims remain"):
        sweep("--batch-size", "3", "--max-batches", "1", verbosity=0)
    assert len(keys()) == 8, "2 of the 3 selected deleted, the taken-over one kept"


def test_the_totals_line_says_how_long_it_took(mixed: None) -> None:
    out = StringIO()
    with clock.freeze(SWEPT_AT):
        call_command("sweep_idempotency", stdout=out)
    assert re.fullmatch(
        r"Deleted 3 expired records and 1 stale claims in \d+\.\d\d s\.\n", out.getvalue()
    )


def test_verbosity_zero_is_silent(mixed: None) -> None:
    assert sweep(verbosity=0) == ""
    assert len(keys()) == 4


def test_batch_size_of_one(mixed: None) -> None:
    assert sweep("--batch-size", "1") == "Deleted 3 expired records and 1 stale claims.\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "0"], "--batch-size must be from 1 to 100000"),
        (["--batch-size", "100001"], "--batch-size must be from 1 to 100000"),
        (["--batch-size", "many"], "invalid int value"),
        (["--max-batches", "0"], "--max-batches must be at least 1"),
        (["--stale-after", "59"], "--stale-after must be at least LEASE (60s)"),
        (["--stale-after", "-5"], "--stale-after must be at least LEASE"),
        (["--database", "nope"], "Unknown database 'nope'"),
    ],
)
def test_bad_options_are_refused(args: list[str], message: str, mixed: None) -> None:
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sweep(*args)
    assert len(keys()) == 8


def test_uses_the_idempotency_clock(mixed: None) -> None:
    """Two hours on, every record here is past its window."""
    out = StringIO()
    with clock.freeze(NOW + timedelta(hours=2)):
        call_command("sweep_idempotency", "--stale-after", "100000", stdout=out)
    assert out.getvalue().startswith("Deleted 8 expired records and 0 stale claims in ")


@contextlib.contextmanager
def completed_just_before_the_delete(key: str) -> Iterator[list[str]]:
    """The claim's owner completes it between the sweep's (or the admin's)
    choice of rows and its DELETE, with a ``pre_delete`` receiver connected,
    as many projects have one. Yields every statement sent."""
    table = IdempotencyRecord._meta.db_table
    sent: list[str] = []

    def owner_completes(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        if sql.lstrip().upper().startswith("DELETE") and table in sql:
            IdempotencyRecord.objects.filter(key=key).update(
                status=COMPLETED, locked_until=None, response_status=201
            )
        return execute(sql, params, many, context)

    def audit(**kwargs: Any) -> None:
        pass

    pre_delete.connect(audit, sender=IdempotencyRecord, dispatch_uid="test-audit")
    try:
        with connection.execute_wrapper(owner_completes):
            yield sent
    finally:
        pre_delete.disconnect(sender=IdempotencyRecord, dispatch_uid="test-audit")


def test_a_claim_completed_during_the_sweep_is_kept_whatever_the_receivers() -> None:
    make("stale-claim", IN_PROGRESS, lease_left=-LEASE - 1)
    with completed_just_before_the_delete("stale-claim") as sent:
        output = sweep()
    assert output == "Deleted 0 expired records and 0 stale claims.\n"
    assert IdempotencyRecord.objects.get(key="stale-claim").status == COMPLETED
    assert not [sql for sql in sent if "response_body" in sql], "no body is ever loaded"
