"""sweep_idempotency's throughput and memory on a big table, on PostgreSQL.

    .venv/bin/python -m benchmarks.sweep_bench [--rows 1000000]

Loads N records with COPY (half expired, interleaved with live ones, plus a
few live and stale claims), times the admin list and searches on the full
table, then runs the command in a child process (so its peak RSS is its
own) while a thread keeps claiming and replaying keys, and checks that
exactly the expired half and the stale claims are gone. Uses the bench
settings' large tables (the schema ``bench_large`` of the bench database,
as ``large_table.py`` does, which rebuilds it on its next run); query plans
and MariaDB are ``large_table.py``'s.
"""

from __future__ import annotations

import argparse
import re
import resource
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CLAIMS = 1000  # live claims and stale claims, each


def setup() -> None:
    """PostgreSQL (COPY loads the rows), the large tables' settings, migrated."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import setup_django, use_database

    use_database("postgres")
    setup_django("benchmarks.benchproject.large_settings")
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def load(rows: int, now: datetime) -> None:
    """COPY: rows alternate expired / live; then CLAIMS live and CLAIMS stale claims."""
    from django.db import connection

    from idempotency_app.models import IdempotencyRecord

    table = IdempotencyRecord._meta.db_table
    columns = (
        "scope, key, operation, fingerprint, status, token, created_at, expires_at, "
        "locked_until, response_status, response_headers, response_body, format_version"
    )
    headers = '[["Content-Type","application/json"],["Location","/charges/1/"]]'
    operations = ["POST charges/", "POST refunds/", "PATCH charges/<int:pk>/", "POST payouts/"]
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {table} RESTART IDENTITY")
        with cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
            for i in range(rows):
                expired = i % 2 == 0
                created = now - timedelta(hours=30 if expired else 1, seconds=i % 3600)
                copy.write_row(
                    (
                        f"user:{i % 5000}",
                        f"key-{i:09d}",
                        operations[i % len(operations)],
                        "f" * 64,
                        "completed",
                        "t" * 32,
                        created,
                        created + timedelta(hours=24),
                        None,
                        201,
                        headers,
                        b'{"id":%d,"amount":500,"currency":"eur"}' % i,
                        1,
                    )
                )
            for i in range(2 * CLAIMS):
                live = i < CLAIMS
                copy.write_row(
                    (
                        "user:claims",
                        f"{'live' if live else 'stale'}-claim-{i}",
                        operations[0],
                        "f" * 64,
                        "in_progress",
                        "t" * 32,
                        now - timedelta(minutes=30),
                        now + timedelta(hours=23),
                        now + timedelta(hours=1) if live else now - timedelta(minutes=29),
                        None,
                        "",
                        None,
                        1,
                    )
                )
        cursor.execute(f"ANALYZE {table}")


def time_admin(label: str, rows: int) -> None:
    from django.contrib.auth.models import User
    from django.test import Client

    user, _ = User.objects.get_or_create(
        username="bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    url = "/admin/idempotency_app/idempotencyrecord/"
    middle = f"key-{rows // 2 + 1:09d}"
    pages = [
        ("changelist", {}),
        ("search by key", {"q": middle}),
        ("search by scope", {"q": "user:43"}),
        ("search scope + key", {"q": f"user:{(rows // 2 + 1) % 5000} {middle}"}),
        ("filter status", {"status__exact": "in_progress"}),
        ("filter expired", {"expired": "yes"}),
        ("filter operation", {"operation": "POST refunds/"}),
    ]
    print(f"admin on {label} (median of 3, ms):")
    for name, params in pages:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            response = client.get(url, params)
            times.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, (name, response.status_code)
        found = re.search(r"(\d+) idempotency records?", response.content.decode())
        print(f"  {name:<20} {median(times):8.1f}   ({found[1] if found else '?'} counted)")


def traffic(stop: threading.Event, results: dict[str, Any]) -> None:
    """Claims new keys and replays one, as live requests would, during the sweep."""
    from django.db import connection

    from idempotency_app.lifecycle import units
    from idempotency_app.lifecycle.claims import Policy, Replay
    from idempotency_app.store import Identity, StoredResponse

    policy = Policy.from_settings()
    stored = StoredResponse(201, (("Content-Type", "application/json"),), b"{}")
    latencies: list[float] = []
    errors = 0
    i = 0
    while not stop.is_set():
        identity = Identity("user:traffic", f"traffic-{i}", "POST charges/", "f" * 64)
        start = time.perf_counter()
        try:
            first = units.run(identity, lambda: None, lambda _: stored, policy)
            again = units.run(identity, lambda: None, lambda _: stored, policy)
            if not (isinstance(first, units.Executed) and isinstance(again, Replay)):
                errors += 1
        except Exception:
            errors += 1
        latencies.append((time.perf_counter() - start) * 1000)
        i += 1
    connection.close()
    results.update(requests=2 * i, errors=errors, latencies=sorted(latencies))


def run_sweep(batch_size: int) -> tuple[float, float, int, str]:
    """The command in a child process; returns the process's seconds, the
    command's own seconds (without Python and Django start-up), its peak RSS
    (KiB) and its output."""
    code = (
        "import django, resource, sys, time; django.setup();"
        "from django.core.management import call_command;"
        "start = time.perf_counter();"
        f"call_command('sweep_idempotency', '--batch-size', '{batch_size}', verbosity=1);"
        "print(time.perf_counter() - start, file=sys.stderr);"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    command_seconds, peak_kib = done.stderr.strip().splitlines()[-2:]
    return (
        time.perf_counter() - start,
        float(command_seconds),
        int(peak_kib),
        done.stdout.strip(),
    )


def baseline_rss() -> int:
    code = (
        "import django, resource, sys; django.setup();"
        "from django.db import connection; connection.ensure_connection();"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=5000)  # the command's default
    parser.add_argument("--skip-admin", action="store_true")
    args = parser.parse_args()
    setup()
    from django.db import connection

    from idempotency_app import clock
    from idempotency_app.models import IdempotencyRecord

    now = clock.now()
    start = time.perf_counter()
    load(args.rows, now)
    print(f"loaded {args.rows + 2 * CLAIMS} records in {time.perf_counter() - start:.1f}s")
    if not args.skip_admin:
        time_admin(f"{args.rows + 2 * CLAIMS} rows", args.rows)
    connection.close()

    stop = threading.Event()
    results: dict[str, Any] = {}
    thread = threading.Thread(target=traffic, args=(stop, results))
    thread.start()
    seconds, command_seconds, peak_kib, output = run_sweep(args.batch_size)
    stop.set()
    thread.join()

    expired = (args.rows + 1) // 2
    deleted = expired + CLAIMS
    left = IdempotencyRecord.objects.exclude(scope="user:traffic")
    remaining = left.count()
    said = re.match(r"Deleted (\d+) expired records and (\d+) stale claims", output)
    assert said and (int(said[1]), int(said[2])) == (expired, CLAIMS), output
    assert remaining == args.rows - expired + CLAIMS, remaining
    assert not left.filter(expires_at__lte=now).exists()
    assert left.filter(key__startswith="live-claim-").count() == CLAIMS
    assert not left.filter(key__startswith="stale-claim-").exists()
    lat = results["latencies"]
    print(f"sweep: {output}")
    print(
        f"  the command: {command_seconds:.2f}s, {deleted / command_seconds:,.0f} rows/s, "
        f"batch size {args.batch_size}"
    )
    print(
        f"  the whole process, with Python and Django start-up: {seconds:.2f}s, "
        f"{deleted / seconds:,.0f} rows/s"
    )
    print(
        f"  peak RSS of the sweep process {peak_kib / 1024:.0f} MiB "
        f"(a process that only starts Django and connects: {baseline_rss() / 1024:.0f} MiB)"
    )
    print(
        f"  concurrent traffic: {results['requests']} claims and replays, {results['errors']} failed, "
        f"p50 {lat[len(lat) // 2]:.1f} ms, p99 {lat[int(len(lat) * 0.99)]:.1f} ms, max {lat[-1]:.1f} ms"
    )
    print(f"  verified: {remaining} records left, none expired, live claims kept")
    again, again_command, _, output = run_sweep(args.batch_size)
    print(
        f"  a second run on the {remaining} live rows: {again_command:.2f}s in the command, "
        f"{again:.2f}s in all ({output})"
    )
    if not args.skip_admin:
        # What autovacuum soon does after a big first sweep: until then,
        # index scans still step over the deleted rows' entries.
        with connection.cursor() as cursor:
            cursor.execute(f"VACUUM ANALYZE {IdempotencyRecord._meta.db_table}")
        time_admin(f"{remaining} rows after the sweep and VACUUM", args.rows)
    loader_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"max RSS of this process (loader): {loader_kib / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
