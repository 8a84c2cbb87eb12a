"""The records table at a million rows: the admin, the sweep and its command, with query plans.

    .venv/bin/python -m benchmarks.large_table                       # PostgreSQL, 1,000,000 rows
    .venv/bin/python -m benchmarks.large_table --database mysql      # MariaDB, 300,000 rows
    .venv/bin/python -m benchmarks.large_table --library /tmp/base   # an earlier checkout's library
    .venv/bin/python -m benchmarks.large_table --rows 20000 --only admin   # a quick look

Every run rebuilds the table from nothing (PostgreSQL: the schema
``bench_large`` of the bench database; MariaDB: the database
``bench_large``) with the migrations of the library under test, then fills
it on the server (``records.REALISTIC``: a few hundred scopes, created over
TTL, the oldest 9% past their expiry, 0.1% claims whose worker died, the
newest 0.2% claims under a live lease). So the same command gives the
figures before and after a change to the schema or to these code paths:
once with ``--library`` pointing at a checkout of the earlier commit, once
without. Each measurement shows the statements that touched the records
table, their time, and their plans (``EXPLAIN (ANALYZE, BUFFERS)`` for a
PostgreSQL SELECT, MariaDB's ``ANALYZE`` for its SELECTs, ``EXPLAIN``
otherwise):

admin    the real admin changelist through Django's test client as a
         superuser: unfiltered, searched by key, by scope, by both
sort     the changelist sorted by expiry both ways; a day picked in the
         date drill-down
stale    the stale-claim pass (``sweep.batches("stale")``), with claims to
         delete and with none; one automatic round (``sweep.auto_sweep``),
         statement by statement
command  ``sweep_idempotency --max-batches`` with a backlog: its output, exit
         status and duration, and what it left behind
batches  the sweep command at ``--batch-size`` 100000 and 5000 while a
         thread claims new keys: what each claim waited, against the same
         claims with no sweep running
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import records
from benchmarks.common import (
    ROOT,
    git_describe,
    imports_from,
    library_shim,
    machine,
    median,
    percentile,
    print_machine,
    setup_django,
    table,
    use_database,
    vendor,
)

SETTINGS = "benchmarks.benchproject.large_settings"
URL = "/admin/idempotency_app/idempotencyrecord/"
REPEATS = 3  # timings per admin page; the median is shown
ON_RECORDS = re.compile(r'(?:FROM|UPDATE|INTO)\s+[`"]idempotency_app_idempotencyrecord[`"]')
# How the sweep command is started in a child process: from the shim's
# directory when a library is given (the current directory comes first on
# the path of ``python -c``), from this checkout otherwise.
MANAGE = (
    "import sys; from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', *sys.argv[1:]])"
)
DEFAULT_ROWS = {"postgresql": 1_000_000, "mysql": 300_000}


# ------------------------------------------------------------ set-up


def rebuild(rows: int) -> str:
    """Drop the large tables' home, migrate it anew with the library under
    test, fill it; a description of what is there."""
    from django.core.management import call_command
    from django.db import connection

    from idempotency_app.conf import conf

    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("DROP DATABASE IF EXISTS bench_large")
            cursor.execute("CREATE DATABASE bench_large CHARACTER SET utf8mb4")
        else:
            cursor.execute("DROP SCHEMA IF EXISTS bench_large CASCADE")
            cursor.execute("CREATE SCHEMA bench_large")
    connection.close()
    call_command("migrate", verbosity=0, interactive=False)
    started = time.perf_counter()
    records.fill("default", rows, records.REALISTIC, ttl=conf.TTL, lease=conf.LEASE)
    took = time.perf_counter() - started
    return (
        f"filled {rows:,} rows in {took:.1f} s; table + indexes {records.size('default')}\n"
        + kinds()
        + "\n\nIndexes:\n"
        + indexes()
    )


def count(kind: str) -> int:
    """How many records the sweep's own condition for ``kind`` ("expired"
    or "stale", the latter with the LEASE grace) matches now."""
    from django.db import connection

    from idempotency_app import store
    from idempotency_app.conf import conf

    records = store.backend(conf.DATABASE_ALIAS)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*) FROM {records.table} WHERE {records.sweep_conditions[kind]}",
            records.sweep_params(conf.LEASE),
        )
        return int(cursor.fetchone()[0])


def kinds() -> str:
    """What the table holds, by the sweep's own conditions."""
    from django.utils import timezone

    from idempotency_app.models import IdempotencyRecord

    records_ = IdempotencyRecord.objects.all()
    in_progress = records_.filter(status="in_progress")
    counts = [
        ["all", records_.count()],
        ["expired (the sweep's condition)", count("expired")],
        ["stale claims (lease lapsed over LEASE ago)", count("stale")],
        ["claims under a live lease", in_progress.filter(locked_until__gt=timezone.now()).count()],
        ["scopes", records_.values("scope").distinct().count()],
    ]
    return table(["records", "count"], [[name, f"{n:,}"] for name, n in counts])


def indexes() -> str:
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"SHOW INDEX FROM {records.TABLE}")
            names = [c[0] for c in cursor.description]
            found: dict[str, list[str]] = {}
            for row in cursor.fetchall():
                entry = dict(zip(names, row, strict=True))
                found.setdefault(entry["Key_name"], []).append(entry["Column_name"])
            return "\n".join(f"  {name} ({', '.join(cols)})" for name, cols in found.items())
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() "
            "AND tablename = %s ORDER BY indexname",
            [records.TABLE],
        )
        return "\n".join(f"  {row[0]}" for row in cursor.fetchall())


# ------------------------------------------------------------ statements and plans


@contextmanager
def statements() -> Iterator[list[tuple[float, str]]]:
    """The statements on the records table run meanwhile: milliseconds, and
    the SQL as sent, parameters in place (Django's own capture rounds times
    to the millisecond)."""
    from django.db import connection

    found: list[tuple[float, str]] = []

    def timed_execute(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            ms = (time.perf_counter() - started) * 1000
            if ON_RECORDS.search(sql):
                sent = context["connection"].ops.last_executed_query(
                    context["cursor"].cursor, sql, params
                )
                found.append((ms, sent))

    with connection.execute_wrapper(timed_execute):
        yield found


def plan(sql: str) -> str:
    """The statement's plan: executed for a SELECT on PostgreSQL (EXPLAIN
    ANALYZE) and MariaDB (ANALYZE: r_rows, the rows each step really read),
    the planner's estimate for anything that writes, and on MySQL."""
    from django.db import connection

    reads = sql.lstrip().upper().startswith("SELECT")
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            analyze = reads and connection.mysql_is_mariadb
            cursor.execute(f"ANALYZE {sql}" if analyze else f"EXPLAIN {sql}")
            headers = [c[0] for c in cursor.description]
            rows = [["" if v is None else v for v in row] for row in cursor.fetchall()]
            return table(headers, rows)
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) {sql}" if reads else f"EXPLAIN {sql}")
        return "\n".join(row[0] for row in cursor.fetchall())


def show(found: list[tuple[float, str]], plans: bool = True) -> str:
    """Each statement: its time, its text (shortened), its plan."""
    lines = []
    for ms, sql in found:
        shown = sql if len(sql) <= 300 else sql[:300] + " ..."
        lines.append(f"  {ms:9.2f} ms  {shown}")
        # A claim's INSERT is not what these sections are about.
        if plans and not sql.lstrip().upper().startswith(("INSERT", "WITH")):
            lines += ["      " + line for line in plan(sql).splitlines()]
    return "\n".join(lines) or "  (no statement on the records table)"


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return (time.perf_counter() - started) * 1000, result


# ------------------------------------------------------------ the admin


def admin_client() -> Any:
    from django.contrib.auth.models import User
    from django.test import Client

    user, _ = User.objects.get_or_create(
        username="bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    return client


def pages(client: Any, wanted: list[tuple[str, dict[str, str]]]) -> str:
    """Each page timed (median of REPEATS), then fetched once more to
    capture its statements on the records table and plan them."""
    out = []
    for title, params in wanted:
        times = []
        for _ in range(REPEATS):
            ms, response = timed(lambda params=params: client.get(URL, params))
            if response.status_code != 200:
                raise RuntimeError(f"{title}: {response.status_code} {response.content[:300]!r}")
            times.append(ms)
        counted = re.search(r"([\d,]+) idempotency records?", response.content.decode())
        with statements() as found:
            client.get(URL, params)
        query = "&".join(f"{k}={v}" for k, v in params.items()) or "(none)"
        out.append(
            f"### {title}: {median(times):,.1f} ms (median of {REPEATS}; ?{query}; "
            f"{counted[1] if counted else '?'} shown as counted)\n{show(found)}\n"
        )
    return "\n".join(out)


def admin_search(rows: int) -> str:
    g = rows // 2 + 1
    key, scope = records.key(g), records.scope(g, records.REALISTIC)
    return pages(
        admin_client(),
        [
            ("changelist, unfiltered", {}),
            ("search by key", {"q": key}),
            ("search by scope", {"q": scope}),
            ("search by scope and key", {"q": f"{scope} {key}"}),
        ],
    )


def admin_sort() -> str:
    from django.contrib import admin
    from django.utils import timezone

    from idempotency_app.models import IdempotencyRecord

    columns = list(admin.site._registry[IdempotencyRecord].list_display)
    expiry = columns.index("expires_at") + 1
    day = timezone.localdate(timezone.now()) - timedelta(days=1)
    drill = {
        "created_at__year": day.year,
        "created_at__month": day.month,
        "created_at__day": day.day,
    }
    return pages(
        admin_client(),
        [
            ("sorted by expiry, ascending", {"o": str(expiry)}),
            ("sorted by expiry, descending", {"o": f"-{expiry}"}),
            (f"a day in the date drill-down ({day})", {k: str(v) for k, v in drill.items()}),
        ],
    )


# ------------------------------------------------------------ the sweep command


class Command:
    """``manage.py`` in a child process, importing the library under test."""

    def __init__(self, shim: tempfile.TemporaryDirectory[str] | None) -> None:
        self.cwd = shim.name if shim is not None else str(ROOT)
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "PYTHONPATH": str(ROOT)}

    def start(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", MANAGE, *args],
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, *args: str) -> tuple[int, str, str, float]:
        """Exit status, output, errors, and seconds, process start-up included."""
        started = time.perf_counter()
        process = self.start(*args)
        out, err = process.communicate()
        return process.returncode, out.strip(), err.strip(), time.perf_counter() - started


def left() -> str:
    expired, stale = count("expired"), count("stale")
    return f"left: {expired:,} expired records, {stale:,} stale claims"


def make_stale(every: int = 1000, remainder: int = 8) -> int:
    """Turn every ``every``-th live completed record into a claim whose
    worker died an hour ago, as the fill does, for a section that needs
    stale claims after another deleted them."""
    from django.db.models.functions import Mod
    from django.utils import timezone

    from idempotency_app.models import IdempotencyRecord

    now = timezone.now()
    chosen = IdempotencyRecord.objects.annotate(slot=Mod("pk", every)).filter(
        slot=remainder, status="completed", expires_at__gt=now
    )
    return chosen.update(
        status="in_progress",
        locked_until=now - timedelta(hours=1),
        response_status=None,
        response_headers="",
        response_body=None,
    )


def command_backlog(command: Command) -> str:
    """What cron sees of a sweep that falls behind: two runs bounded by
    --max-batches, one with the totals line, one silent (-v 0), with
    expired records and stale claims both waiting."""
    from idempotency_app.models import IdempotencyRecord

    if not count("stale"):
        make_stale()
    if not count("expired"):
        make_backlog(IdempotencyRecord.objects.count() // 10)
    expired = count("expired")
    batch = max(1, min(5000, expired // 5))  # a backlog whatever --rows says
    out = [f"before: {left()[6:]}; batch size {batch}"]
    for args in (["--max-batches", "2"], ["--max-batches", "1", "-v", "0"]):
        argv = ["sweep_idempotency", "--batch-size", str(batch), *args]
        status, stdout, stderr, seconds = command.run(*argv)
        out.append(
            f"\n$ manage.py {' '.join(argv)}\n"
            f"  exit status {status}, {seconds:.2f} s with start-up\n"
            f"  stdout: {stdout or '(nothing)'}\n"
            f"  stderr: {stderr.splitlines()[-1] if stderr else '(nothing)'}\n  {left()}"
        )
    return "\n".join(out)


# ------------------------------------------------------------ the stale-claim pass


def stale_pass() -> str:
    from django.utils import timezone

    from idempotency_app import sweep
    from idempotency_app.conf import conf

    using = conf.DATABASE_ALIAS
    batch = 5000

    def stale_batches(dry_run: bool) -> int:
        return sum(sweep.batches("stale", batch, using, dry_run, conf.LEASE))

    out = []
    for title, dry_run in (
        ("stale-claim pass, counting (--dry-run), claims present", True),
        ("stale-claim pass, deleting", False),
        ("stale-claim pass, nothing left to delete", False),
    ):
        with statements() as found:
            ms, count = timed(lambda dry_run=dry_run: stale_batches(dry_run))
        out.append(f"### {title}: {ms:,.1f} ms, {count:,} claims\n{show(found)}\n")
    interval = 300.0
    with statements() as found:
        ms, deleted = timed(lambda: sweep.auto_sweep(timezone.now(), interval))
    out.append(
        f"### one automatic round (auto_sweep, interval {interval:g} s): {ms:,.1f} ms, "
        f"deleted {deleted}\n{show(found)}\n"
    )
    return "\n".join(out)


# ------------------------------------------------------------ batch size and claims


class Claimer(threading.Thread):
    """Claims new keys one after another, completing each, as requests
    would; records how long each claim took."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.stop = threading.Event()
        self.times: list[float] = []
        self.failed = 0

    def run(self) -> None:
        from django.db import connection

        from idempotency_app.lifecycle import units
        from idempotency_app.lifecycle.claims import Claim, Policy, claim
        from idempotency_app.store import Identity, StoredResponse

        policy = Policy.from_settings()
        stored = StoredResponse(201, (("Content-Type", "application/json"),), b"{}")
        i = 0
        while not self.stop.is_set():
            identity = Identity("user:claims", f"{self.prefix}-{i}", "POST charges/", "f" * 64)
            started = time.perf_counter()
            try:
                held = claim(identity, policy)
                self.times.append((time.perf_counter() - started) * 1000)
                if isinstance(held, Claim):
                    units.execute(held, lambda: None, lambda _: stored)
                else:
                    self.failed += 1
            except Exception:
                self.failed += 1
            i += 1
        connection.close()

    def figures(self) -> list[str]:
        t = self.times
        return [
            f"{len(t):,}",
            f"{median(t):.1f}",
            f"{percentile(t, 0.99):.1f}",
            f"{max(t, default=float('nan')):.1f}",
            str(self.failed),
        ]


def make_backlog(rows: int) -> int:
    """Turn the oldest ``rows`` live completed records expired an hour ago,
    as a sweep that fell behind finds them (oldest ids first)."""
    from django.db import connection
    from django.utils import timezone

    from idempotency_app.models import IdempotencyRecord

    live = IdempotencyRecord.objects.filter(
        status="completed", expires_at__gt=timezone.now()
    ).order_by("pk")
    last = list(live.values_list("pk", flat=True)[rows - 1 : rows])
    if last:
        live = live.filter(pk__lte=last[0])
    count = live.update(expires_at=timezone.now() - timedelta(hours=1))
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {records.TABLE}")
            cursor.fetchall()
        else:
            cursor.execute(f"VACUUM ANALYZE {records.TABLE}")
    return count


def batch_sizes(command: Command, backlog: int, sizes: tuple[int, ...]) -> str:
    """Per batch size: a fresh backlog, claims with no sweep for a moment
    (the reference), then the same claims while the command sweeps."""
    from django.db import connection

    from idempotency_app.models import IdempotencyRecord

    rows = []
    for size in sizes:
        live = IdempotencyRecord.objects.filter(status="completed").count()
        made = make_backlog(min(backlog, live // 3))
        connection.close()
        quiet = Claimer(f"quiet-{size}-{time.time()}")
        quiet.start()
        time.sleep(2)
        quiet.stop.set()
        quiet.join()
        busy = Claimer(f"busy-{size}-{time.time()}")
        busy.start()
        status, stdout, stderr, seconds = command.run(
            "sweep_idempotency", "--batch-size", str(size)
        )
        busy.stop.set()
        busy.join()
        said = stdout.splitlines()[-1] if stdout else stderr.splitlines()[-1] if stderr else ""
        figures = [f"{size:,}", f"{made:,}", f"{seconds:.2f}", f"{status}: {said}"]
        rows.append([*figures, *busy.figures(), *quiet.figures()[1:4]])
    headers = ["batch size", "backlog made", "command s", "exit: output", "claims"]
    headers += ["claim p50 ms", "p99 ms", "max ms", "failed", "quiet p50", "quiet p99", "quiet max"]
    return table(headers, rows) + (
        "\n(a thread claims and completes new keys throughout; 'quiet': the same for 2 s "
        "just before, with no sweep running)"
    )


# ------------------------------------------------------------ main


SECTIONS = ("admin", "sort", "stale", "command", "batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database", choices=["postgres", "mysql"], default="postgres")
    parser.add_argument("--rows", type=int, help="records to load (default 1M; 300k on MariaDB)")
    parser.add_argument(
        "--library", type=Path, metavar="DIR", help="measure the idempotency_app of this checkout"
    )
    parser.add_argument(
        "--backlog", type=int, default=100_000, help="expired rows per batch-size run"
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[100_000, 5000], help="for 'batches'"
    )
    parser.add_argument("--only", choices=SECTIONS, action="append")
    args = parser.parse_args()
    shim = library_shim(args.library) if args.library else None
    if shim is not None:
        sys.path.insert(0, shim.name)  # before anything imports idempotency_app
    use_database(args.database)
    setup_django(SETTINGS)
    import idempotency_app

    checkout = (args.library or ROOT).resolve()
    if not imports_from(idempotency_app.__file__, checkout):
        sys.exit(f"imports {idempotency_app.__file__}, not {checkout}'s idempotency_app")
    print_machine(machine())
    rows = args.rows or DEFAULT_ROWS[vendor()]
    print(f"library: {checkout / 'idempotency_app'} at {git_describe(checkout)}")
    print(rebuild(rows), end="\n\n", flush=True)
    command = Command(shim)
    sections: list[tuple[str, str, Callable[[], str]]] = [
        ("admin", "The admin's search (a)", lambda: admin_search(rows)),
        ("sort", "The admin sorted by expiry, and a day in the drill-down (c)", admin_sort),
        ("stale", "The stale-claim pass and an automatic round (b)", stale_pass),
        (
            "command",
            "sweep_idempotency --max-batches with a backlog (e)",
            lambda: command_backlog(command),
        ),
        (
            "batches",
            "Sweep batch size against concurrent claims (d)",
            lambda: batch_sizes(command, args.backlog, tuple(args.batch_sizes)),
        ),
    ]
    for name, title, section in sections:
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        text = section()
        print(f"## {title}  ({time.perf_counter() - started:.0f} s)\n\n{text}\n", flush=True)
    if shim is not None:
        shim.cleanup()


if __name__ == "__main__":
    main()
