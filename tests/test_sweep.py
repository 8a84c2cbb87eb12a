"""sweep_idempotency against real rows: what goes, what stays, and the options."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from idempotency_app import clock
from idempotency_app.models import IdempotencyRecord

pytestmark = pytest.mark.django_db

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)
LEASE = 60  # the default setting
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
    out = StringIO()
    with clock.freeze(NOW):
        call_command("sweep_idempotency", *args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


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


def test_max_batches_bounds_the_whole_run(settings: Any) -> None:
    for i in range(7):
        make(f"expired-{i}", expires_in=-1)
    make("stale", IN_PROGRESS, lease_left=-1000)
    assert sweep("--batch-size", "3", "--max-batches", "2") == (
        "Deleted 6 expired records and 0 stale claims.\n"
    )
    assert sweep("--batch-size", "3", "--max-batches", "2") == (
        "Deleted 1 expired records and 1 stale claims.\n"
    )
    assert keys() == set()


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
    assert out.getvalue() == "Deleted 8 expired records and 0 stale claims.\n"
