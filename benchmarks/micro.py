"""Micro-figures on PostgreSQL or MariaDB + Redis, in one process (no HTTP server).

    .venv/bin/python -m benchmarks.micro            # all sections, PostgreSQL
    .venv/bin/python -m benchmarks.micro --database mysql   # the same on MariaDB
    .venv/bin/python -m benchmarks.micro --rows 200000 --claims 500   # quicker

1. Round trips per request: every exchange with the database (PostgreSQL:
   read from libpq's protocol trace; MariaDB: every call into the client
   library that talks to the server, checked against the server's own
   ``Questions`` counter), so BEGIN, COMMIT and autocommit switches count
   too; the transactions among them, and the Redis commands of the guard.
2. Claim latency with 10k and with --rows (default 1M) records in the table,
   for new keys (the INSERT wins) and for existing keys (the read path), with
   the commit flushed to disk (as deployed) and, on PostgreSQL, not
   (synchronous_commit off for this session: the index cost alone; InnoDB's
   equivalent is a server-wide setting, which a benchmark must not change).
3. PostgreSQL: the claim statement on an existing key: sequence values it
   burns and what that does to p99, next to a variant that skips the INSERT.
4. Fingerprint cost on 1 KB, 64 KB, 100 KB and 1 MB JSON bodies.
5. Time per request in process, the pieces timed alone, where a fresh
   request's CPU goes (each phase timed in place, no profiler), and a
   profile of decorated requests.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import random
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import records
from benchmarks.common import (
    AUTH,
    BODY,
    machine,
    median,
    percentile,
    print_machine,
    reset_schema,
    setup_django,
    table,
    truncate,
    use_database,
    vendor,
)


def client() -> Any:
    from django.test import Client

    return Client(**AUTH)


def post(c: Any, path: str, key: str | None = None, body: str = BODY) -> Any:
    extra = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return c.post(path, body, content_type="application/json", **extra)


# ------------------------------------------------------------ 1. round trips


@contextmanager
def protocol_trace() -> Iterator[list[str]]:
    """PostgreSQL: the frontend/backend messages exchanged meanwhile, from libpq's trace."""
    from django.db import connection
    from psycopg import pq

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    lines: list[str] = []
    with tempfile.TemporaryFile() as sink:
        pgconn.trace(sink.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield lines
        finally:
            pgconn.untrace()
            sink.seek(0)
            lines.extend(sink.read().decode("utf-8", "replace").splitlines())


def summarize_trace(lines: list[str]) -> tuple[int, int, list[str]]:
    """PostgreSQL: round trips (one per ReadyForQuery), transactions ended, statements."""
    round_trips = sum(1 for line in lines if "\tReadyForQuery\t" in line)
    transactions = sum(
        1 for line in lines if "\tReadyForQuery\t" in line and line.rstrip().endswith("I")
    )
    statements = [
        short_sql(line.split("\t", 3)[3])
        for line in lines
        if line.startswith("F") and "\tQuery\t" in line
    ]
    return round_trips, transactions, statements


@dataclass
class MysqlTrace:
    """MariaDB: every call into mysqlclient that talks to the server, in
    order (a query, a commit, a rollback, an autocommit switch that changes
    the state), and the server's own count of statements as a check."""

    calls: list[tuple[str, str]] = field(default_factory=list)  # (kind, text)
    server_count: int = 0


def _questions(raw: Any) -> int:
    cursor = raw.cursor()
    cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
    count = int(cursor.fetchone()[1])
    cursor.close()
    return count


@contextmanager
def mysql_trace() -> Iterator[MysqlTrace]:
    from django.db import connection

    connection.ensure_connection()
    raw = connection.connection
    trace = MysqlTrace()

    def query(sql: bytes | str) -> Any:
        text = sql.decode("utf-8", "replace") if isinstance(sql, bytes | bytearray) else sql
        trace.calls.append(("query", text))
        return type(raw).query(raw, sql)

    def commit() -> Any:
        trace.calls.append(("commit", "COMMIT"))
        return type(raw).commit(raw)

    def rollback() -> Any:
        trace.calls.append(("rollback", "ROLLBACK"))
        return type(raw).rollback(raw)

    def autocommit(on: bool) -> Any:
        if raw.get_autocommit() != bool(on):  # otherwise mysqlclient sends nothing
            trace.calls.append(("autocommit", f"SET autocommit={int(bool(on))}"))
        return type(raw).autocommit(raw, on)

    wrappers = {"query": query, "commit": commit, "rollback": rollback, "autocommit": autocommit}
    # The connection type refuses to delete attributes: put bound methods back.
    originals = {name: getattr(raw, name) for name in wrappers}
    before = _questions(raw)
    for name, wrapper in wrappers.items():
        setattr(raw, name, wrapper)
    try:
        yield trace
    finally:
        for name, original in originals.items():
            setattr(raw, name, original)
        # The second SHOW counts itself.
        trace.server_count = _questions(raw) - before - 1


def summarize_mysql(trace: MysqlTrace) -> tuple[str, int, list[str]]:
    """Round trips (checked against the server's count), transactions ended
    (a statement under autocommit, a commit, a rollback), statements."""
    transactions = 0
    autocommit = True
    for kind, text in trace.calls:
        if kind == "autocommit":
            autocommit = text.endswith("1")
        elif kind in ("commit", "rollback") or autocommit:
            transactions += 1
    trips = str(len(trace.calls))
    if trace.server_count != len(trace.calls):
        trips += f" (server counted {trace.server_count})"
    return trips, transactions, [short_sql(text) for _, text in trace.calls]


def short_sql(message: str) -> str:
    """One round trip's statements, named; several sent in one message are
    joined with " + " (the bench's own statements hold no semicolon)."""
    parts = [part for part in message.split(";") if part.strip()]
    return " + ".join(_short_statement(part) for part in parts) or "?"


def _short_statement(sql: str) -> str:
    sql = sql.strip().strip('"')
    words = sql.split()
    table_match = re.search(r'(?:INTO|FROM|UPDATE)\s+[`"](\w+)[`"]', sql)
    name = (table_match.group(1) if table_match else "").replace(
        "idempotency_app_idempotencyrecord", "record"
    )
    verb = words[0].upper() if words else "?"
    if verb == "WITH" and words[1:2] == ["done"]:
        return f"complete {name}"
    if verb == "WITH":
        return f"claim {name} (INSERT .. ON CONFLICT, SELECT)"
    if verb in ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT") or sql.startswith("SET autocommit"):
        return sql if verb == "SET" else verb
    if verb == "RELEASE":
        return "RELEASE SAVEPOINT"
    return f"{verb} {name}".strip()


class GuardCounter:
    """Counts the guard's Redis commands by wrapping its two raw calls."""

    def __init__(self) -> None:
        from idempotency_app.guard import guard

        self.calls: Counter[str] = Counter()
        for name, command in (("_raw_get", "GET"), ("_raw_set", "SET")):
            original = getattr(guard, name)

            def counted(*args: Any, _original: Any = original, _command: str = command) -> Any:
                self.calls[_command] += 1
                return _original(*args)

            setattr(guard, name, counted)

    def take(self) -> str:
        text = ", ".join(f"{n} {c}" for c, n in sorted(self.calls.items())) or "none"
        self.calls.clear()
        return text


def hold_in_progress(key: str) -> None:
    """Turn a completed record back into a claim held by a slow worker."""
    from idempotency_app import clock
    from idempotency_app.models import IdempotencyRecord

    IdempotencyRecord.objects.filter(key=key).update(
        status="in_progress",
        token="slow-worker",
        locked_until=clock.now() + timedelta(seconds=60),
        response_status=None,
        response_body=None,
    )


def round_trips() -> str:
    c = client()
    counter = GuardCounter()
    replay_key, conflict_key = str(uuid.uuid4()), str(uuid.uuid4())
    post(c, "/plain/")
    post(c, "/idem/", replay_key)
    post(c, "/idem/", conflict_key)
    hold_in_progress(conflict_key)
    counter.take()
    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("floor", lambda: post(c, "/floor/"), 200),
        ("plain (undecorated)", lambda: post(c, "/plain/"), 201),
        ("no key (decorated)", lambda: post(c, "/idem/"), 201),
        ("fresh", lambda: post(c, "/idem/", str(uuid.uuid4())), 201),
        ("replay", lambda: post(c, "/idem/", replay_key), 201),
        ("conflict (in progress)", lambda: post(c, "/idem/", conflict_key), 409),
        ("mismatch (other body)", lambda: post(c, "/idem/", replay_key, '{"amount": 1}'), 422),
    ]
    mysql = vendor() == "mysql"
    rows = []
    for name, call, expected in cases:
        if mysql:
            with mysql_trace() as trace:
                response = call()
            trips, transactions, statements = summarize_mysql(trace)
        else:
            with protocol_trace() as lines:
                response = call()
            count, transactions, statements = summarize_trace(lines)
            trips = str(count)
        if response.status_code != expected:
            raise RuntimeError(f"{name}: {response.status_code} {response.content[:200]!r}")
        rows.append([name, trips, transactions, counter.take(), "; ".join(statements)])
    database = "MariaDB" if mysql else "PG"
    return table(
        ["request", f"{database} round trips", "transactions", "Redis", "statements in order"],
        rows,
    )


# ------------------------------------------------------------ 2. claim latency

SMALL = "default"  # the bench database's own schema, holding 10k records
LARGE = "large"  # a second schema of the same database, holding --rows records
BATCH = 50


def prepare_large(rows: int) -> float:
    """Migrate the large tables' home and fill both tables; returns load seconds."""
    from django.core.management import call_command

    call_command("migrate", database=LARGE, verbosity=0, interactive=False)
    empty(SMALL)
    empty(LARGE)
    load_rows(SMALL, 10_000)
    started = time.perf_counter()
    load_rows(LARGE, rows)
    return time.perf_counter() - started


def empty(alias: str) -> None:
    truncate((records.TABLE,), alias)


def load_rows(alias: str, rows: int) -> None:
    """Completed records 1..``rows``, none near its expiry."""
    from idempotency_app.conf import conf

    records.fill(alias, rows, records.COMPLETED, ttl=conf.TTL, lease=conf.LEASE)


def loaded_identity(g: int) -> Any:
    return records.identity(g, records.COMPLETED)


def new_identity() -> Any:
    from idempotency_app.store import Identity

    scope = records.scope(random.randrange(records.COMPLETED.scopes), records.COMPLETED)
    return Identity(scope, str(uuid.uuid4()), "POST idem/", "f" * 64)


@contextmanager
def synchronous_commit(on: bool, aliases: tuple[str, ...] = (SMALL,)) -> Iterator[None]:
    """PostgreSQL only: whether this session's commits wait for the WAL flush."""
    from django.db import connections

    for alias in aliases:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"SET synchronous_commit TO {'on' if on else 'off'}")
    try:
        yield
    finally:
        for alias in aliases:
            with connections[alias].cursor() as cursor:
                cursor.execute("RESET synchronous_commit")


def time_claims(identities: list[Any], expect: type, alias: str = SMALL) -> list[float]:
    from idempotency_app.lifecycle.claims import Policy, claim

    policy = replace(Policy.from_settings(), using=alias)
    times = []
    for identity in identities:
        t0 = time.perf_counter()
        decision = claim(identity, policy)
        times.append((time.perf_counter() - t0) * 1000)
        if not isinstance(decision, expect):
            raise RuntimeError(f"expected {expect.__name__}, got {decision!r}")
    return times


def interleaved(
    claims: int, make: Callable[[str], list[Any]], expect: type
) -> dict[str, list[float]]:
    """Claims alternate between the two tables in small batches, so that
    whatever else the machine does weighs on both sizes alike."""
    times: dict[str, list[float]] = {SMALL: [], LARGE: []}
    for _ in range(max(1, claims // BATCH)):
        for alias in (SMALL, LARGE):
            times[alias] += time_claims(make(alias), expect, alias)
    return times


def claim_latency(rows: int, claims: int) -> str:
    from django.db import connections

    from idempotency_app.lifecycle.claims import Claim, Replay
    from idempotency_app.models import IdempotencyRecord

    load_seconds = prepare_large(rows)
    sizes = {SMALL: 10_000, LARGE: rows}
    out = []
    # InnoDB's flush setting is the server's, not the session's: flushed only.
    mysql = vendor() == "mysql"
    for on in (True,) if mysql else (True, False):
        mode = "commit flushed" if on else "no flush"
        with nullcontext() if mysql else synchronous_commit(on, (SMALL, LARGE)):
            interleaved(BATCH * 2, lambda alias: [new_identity() for _ in range(BATCH)], Claim)
            cells = {
                f"new key, {mode}": interleaved(
                    claims, lambda alias: [new_identity() for _ in range(BATCH)], Claim
                ),
                f"existing key, {mode}": interleaved(
                    claims,
                    lambda alias: [
                        loaded_identity(random.randint(1, sizes[alias])) for _ in range(BATCH)
                    ],
                    Replay,
                ),
            }
        for alias in (SMALL, LARGE):
            IdempotencyRecord.objects.using(alias).filter(fingerprint="f" * 64).delete()
        for name, times in cells.items():
            a, b = times[SMALL], times[LARGE]
            out.append(
                [
                    name,
                    f"{median(a):.3f}",
                    f"{percentile(a, 0.99):.3f}",
                    f"{median(b):.3f}",
                    f"{percentile(b, 0.99):.3f}",
                    f"{median(b) / median(a):.2f}x",
                ]
            )
    size = records.size(LARGE)
    empty(LARGE)
    for alias in (SMALL, LARGE):
        connections[alias].close()
    big = f"{rows // 1000}k"
    headers = [
        "claims.claim",
        "10k p50 ms",
        "10k p99 ms",
        f"{big} p50 ms",
        f"{big} p99 ms",
        "p50 ratio",
    ]
    note = (
        f"({claims} claims per cell, alternating between the tables in batches of {BATCH}; "
        f"loading {rows:,} rows took {load_seconds:.1f} s; "
        f"table + indexes at {rows:,} rows: {size})"
    )
    return table(headers, out) + "\n" + note


# ------------------------------------------------------------ 3. sequence burn


VARIANT_SQL = """
WITH ins AS (
  INSERT INTO idempotency_app_idempotencyrecord
    (scope, key, operation, fingerprint, status, token, created_at, expires_at, locked_until,
     response_headers, format_version)
  SELECT %(scope)s, %(key)s, %(op)s, %(fp)s, 'in_progress', %(token)s, %(now)s, %(expires)s,
         %(lease)s, '', 1
  WHERE NOT EXISTS (
    SELECT 1 FROM idempotency_app_idempotencyrecord WHERE scope = %(scope)s AND key = %(key)s)
  ON CONFLICT (scope, key) DO NOTHING RETURNING 1)
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM ins
UNION ALL
SELECT token, operation, fingerprint, status, expires_at <= %(now)s, locked_until <= %(now)s,
       response_status, response_headers, response_body
FROM idempotency_app_idempotencyrecord WHERE scope = %(scope)s AND key = %(key)s
"""


def sequence_value() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT last_value FROM idempotency_app_idempotencyrecord_id_seq")
        return int(cursor.fetchone()[0])


def time_variant(identities: list[Any]) -> list[float]:
    """The variant statement, timed bare (the shipped one is timed through
    claims.claim, so its figure carries a little Python on top)."""
    from django.db import connection

    from idempotency_app import clock

    times = []
    for identity in identities:
        now = clock.now()
        params = {
            "scope": identity.scope,
            "key": identity.key,
            "op": identity.operation,
            "fp": identity.fingerprint,
            "token": "0" * 32,
            "now": now,
            "expires": now + timedelta(days=1),
            "lease": now + timedelta(seconds=60),
        }
        t0 = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute(VARIANT_SQL, params)
            row = cursor.fetchone()
        times.append((time.perf_counter() - t0) * 1000)
        if row is None or row[0] is None:
            raise RuntimeError("the variant inserted over an existing key")
    return times


def sequence_burn(lookups: int) -> str:
    from idempotency_app.lifecycle.claims import Replay

    empty(SMALL)
    load_rows(SMALL, 10_000)
    shipped: list[float] = []
    variant: list[float] = []
    burnt = {"shipped": 0, "variant": 0}
    for _ in range(max(1, lookups // BATCH)):
        identities = [loaded_identity(random.randint(1, 10_000)) for _ in range(BATCH)]
        before = sequence_value()
        shipped += time_claims(identities, Replay)
        middle = sequence_value()
        variant += time_variant(identities)
        burnt["shipped"] += middle - before
        burnt["variant"] += sequence_value() - middle
    empty(SMALL)
    done = len(shipped)
    measured = [
        ("as shipped: INSERT .. ON CONFLICT in a CTE", burnt["shipped"], shipped),
        ("variant: INSERT .. SELECT .. WHERE NOT EXISTS", burnt["variant"], variant),
    ]
    rows = [
        [name, f"{b / done:.2f}", f"{median(t):.3f}", f"{percentile(t, 0.99):.3f}"]
        for name, b, t in measured
    ]
    headers = [
        "claim of an existing key (replay path)",
        "sequence values/lookup",
        "p50 ms",
        "p99 ms",
    ]
    return table(headers, rows) + (
        f"\n({done} lookups each, alternating in batches of {BATCH}; "
        "the variant is timed as bare SQL, without claims.claim's Python)"
    )


# ------------------------------------------------------------ 4. fingerprint


def json_body(size: int) -> bytes:
    items = []
    total = 2
    i = 0
    while True:
        item = json.dumps({"id": i, "label": f"item-{i}", "amount": i * 7, "note": "x" * 40})
        if total + len(item) + 1 > size:
            break
        items.append(item)
        total += len(item) + 1
        i += 1
    body = ("[" + ",".join(items) + "]").encode()
    return body + b" " * (size - len(body))


def fingerprint_cost() -> str:
    import timeit

    from django.urls import resolve
    from rest_framework.parsers import JSONParser
    from rest_framework.request import Request
    from rest_framework.test import APIRequestFactory

    from idempotency_app.http import keys

    factory = APIRequestFactory()
    rows = []
    for label, size in (
        ("1 KB", 1024),
        ("64 KB - 1", 64 * 1024 - 1),
        ("100 KB", 100 * 1024),
        ("1 MB", 1024 * 1024),
    ):
        body = json_body(size)
        django_request = factory.post("/idem/", body, content_type="application/json")
        django_request.resolver_match = resolve("/idem/")
        request = Request(django_request, parsers=[JSONParser()])
        first = keys.fingerprint(request)
        assert keys.fingerprint(request) == first
        canonical = keys.canonical_body(request, body) != body
        number = max(1, 2_000_000 // size)
        timer = timeit.Timer(lambda request=request: keys.fingerprint(request))
        fp = min(timer.repeat(repeat=5, number=number)) / number * 1e6
        sha = timeit.Timer(lambda body=body: hashlib.sha256(body).hexdigest())
        floor = min(sha.repeat(repeat=5, number=number)) / number * 1e6
        rows.append(
            [
                label,
                "canonical JSON" if canonical else "raw bytes",
                f"{fp:,.0f}",
                f"{floor:,.0f}",
                f"{fp / floor:.1f}x",
            ]
        )
    return table(["body", "hashed as", "fingerprint us", "sha256 alone us", "ratio"], rows)


# ------------------------------------------------------------ 5. in process


@contextmanager
def variant(name: str) -> Iterator[None]:
    """Switch one change around the library on for a block of in-process
    requests (changes to the library itself are measured against a baseline
    checkout: ``run.py --baseline``)."""
    from django.test.utils import override_settings

    from benchmarks.benchproject import views

    if name == "no savepoint":
        previous, views.SAVEPOINT = views.SAVEPOINT, False
        try:
            yield
        finally:
            views.SAVEPOINT = previous
    elif name == "guard in local memory":
        from django.conf import settings

        with override_settings(IDEMPOTENCY={**settings.IDEMPOTENCY, "CACHE_ALIAS": "local"}):
            yield
    else:
        yield


FRESH_VARIANTS = ("no savepoint", "guard in local memory")


def per_request(repeats: int) -> str:
    """Wall and CPU time per request through the test client, the scenarios
    and each proposed change interleaved in batches (medians of batch means)."""
    from contextlib import ExitStack

    from django.db import connection

    c = client()
    replay_keys = [str(uuid.uuid4()) for _ in range(16)]
    conflict_key = str(uuid.uuid4())
    for key in replay_keys:
        post(c, "/idem/", key)
    post(c, "/idem/", conflict_key)
    hold_in_progress(conflict_key)

    def fresh(i: int) -> Any:
        return post(c, "/idem/", str(uuid.uuid4()))

    cases: list[tuple[str, tuple[str, ...], Callable[[int], Any]]] = [
        ("floor", (), lambda i: post(c, "/floor/")),
        ("plain", (), lambda i: post(c, "/plain/")),
        ("fresh", (), fresh),
        ("replay", (), lambda i: post(c, "/idem/", replay_keys[i % len(replay_keys)])),
        ("conflict", (), lambda i: post(c, "/idem/", conflict_key)),
    ]
    cases += [(f"fresh, {name}", (name,), fresh) for name in FRESH_VARIANTS]
    cases.append(("fresh, both", FRESH_VARIANTS, fresh))
    wall: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(5):
        for name, changes, call in cases:
            with ExitStack() as stack:
                for change in changes:
                    stack.enter_context(variant(change))
                for i in range(10):
                    call(i)
                w, p = time.perf_counter(), time.process_time()
                for i in range(repeats):
                    call(i)
                wall[name].append((time.perf_counter() - w) / repeats * 1000)
                cpu[name].append((time.process_time() - p) / repeats * 1000)
    plain_wall, plain_cpu = median(wall["plain"]), median(cpu["plain"])
    rows = []
    for name, _, _ in cases:
        w, p = median(wall[name]), median(cpu[name])
        over = f"{w - plain_wall:+.3f} / {p - plain_cpu:+.3f}" if name.startswith("fresh") else ""
        rows.append([name, f"{w:.3f}", f"{p:.3f}", over])
    connection.close()
    headers = [
        "request (test client, in process)",
        "wall ms",
        "CPU ms",
        "over plain ms (wall / CPU)",
    ]
    return table(headers, rows)


def components() -> str:
    """The pieces a decorated request adds, each timed alone, idle machine or not."""
    import secrets

    from django.db import connection, transaction
    from django.urls import resolve
    from rest_framework.parsers import JSONParser
    from rest_framework.request import Request
    from rest_framework.test import APIRequestFactory
    from rest_framework.views import APIView

    from idempotency_app.guard import guard
    from idempotency_app.http import keys
    from idempotency_app.http.replay import replay
    from idempotency_app.lifecycle.claims import Policy, claim
    from idempotency_app.models import IdempotencyRecord
    from idempotency_app.store import Identity, StoredResponse

    replay_key = str(uuid.uuid4())
    post(client(), "/idem/", replay_key)
    record = IdempotencyRecord.objects.get(key=replay_key)
    identity = Identity(record.scope, record.key, record.operation, record.fingerprint)
    policy = Policy.from_settings()
    django_request = APIRequestFactory().post("/idem/", BODY, content_type="application/json")
    django_request.resolver_match = resolve("/idem/")
    request = Request(django_request, parsers=[JSONParser()])
    view = APIView()
    keys.fingerprint(request)
    stored = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id":1}')
    missing = Identity("user:1", "no-such-key", "POST idem/", "f" * 64)

    def savepoint() -> None:
        with transaction.atomic():
            pass

    def in_transaction(call: Callable[[], Any]) -> Callable[[], Any]:
        def wrapped() -> Any:
            with transaction.atomic():
                for _ in range(10):
                    call()

        return wrapped

    pieces: list[tuple[str, Callable[[], Any], int]] = [
        ("claim of an existing key (one statement)", lambda: claim(identity, policy), 1),
        ("SELECT 1 through the Django cursor", lambda: _select_one(connection), 1),
        ("SAVEPOINT + RELEASE (a nested atomic block)", in_transaction(savepoint), 10),
        ("guard.get: a Redis GET that misses", lambda: guard.get(missing), 1),
        ("fingerprint of the bench body (45 bytes)", lambda: keys.fingerprint(request), 1),
        ("replay: stored bytes to a response", lambda: replay(stored, request, view), 1),
        ("secrets.token_hex(16): the claim token", lambda: secrets.token_hex(16), 1),
    ]
    rows = []
    for name, call, per_call in pieces:
        call()
        number = 200
        walls, cpus = [], []
        for _ in range(5):
            w, p = time.perf_counter(), time.process_time()
            for _ in range(number):
                call()
            walls.append((time.perf_counter() - w) / number / per_call * 1e6)
            cpus.append((time.process_time() - p) / number / per_call * 1e6)
        rows.append([name, f"{median(walls):,.0f}", f"{median(cpus):,.0f}"])
    connection.close()
    return table(["piece", "wall us", "CPU us"], rows) + "\n(medians of 5 batches of 200)"


# The phases of a fresh request, each timed where it runs: (module, class or
# "", function, label).
PHASES = (
    ("idempotency_app.http.handling", "", "identify", "identify: key, scope, fingerprint"),
    ("idempotency_app.lifecycle.units", "", "claim", "claim: the statement and its decision"),
    (
        "idempotency_app.lifecycle.units",
        "",
        "execute",
        "execute: the work's transaction, all of it",
    ),
    ("idempotency_app.http.handling", "", "_respond", "  the view, rendered (guarded statements)"),
    ("idempotency_app.http.handling", "", "_settle", "  settle: what to store"),
    ("idempotency_app.lifecycle.units", "Unit", "complete", "  the completion with the COMMIT"),
)


def phases(requests: int) -> str:
    """CPU per fresh request in each phase, next to the undecorated view's
    request: process time summed around each phase (no profiler, so
    Python-heavy code is not inflated), over ``requests`` requests."""
    import importlib

    spent: Counter[str] = Counter()

    def timed(original: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.process_time() - started

        return wrapper

    c = client()
    for _ in range(20):
        post(c, "/idem/", str(uuid.uuid4()))
        post(c, "/plain/")
    started = time.process_time()
    for _ in range(requests):
        post(c, "/plain/")
    plain = (time.process_time() - started) / requests
    originals = []
    for module, cls, name, label in PHASES:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timed(getattr(owner, name), label))
    try:
        started = time.process_time()
        for _ in range(requests):
            post(c, "/idem/", str(uuid.uuid4()))
        fresh = (time.process_time() - started) / requests
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    rows = [["the undecorated view's whole request", f"{plain * 1e6:,.0f}"]]
    rows.append(["a fresh request under @idempotent", f"{fresh * 1e6:,.0f}"])
    rows += [[label, f"{spent[label] / requests * 1e6:,.0f}"] for *_, label in PHASES]
    return table(["what (fresh request, PostgreSQL or MariaDB)", "CPU us"], rows) + (
        f"\n({requests} requests each, through the test client; the indented rows are part of "
        "execute; the rest of a request is Django's and DRF's own handling)"
    )


def _select_one(connection: Any) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


def profile(requests: int) -> str:
    """Two profiles of the same requests: CPU time (what throughput pays on a
    busy machine) and wall time (what latency pays, waits included)."""
    c = client()
    for _ in range(20):
        post(c, "/idem/", str(uuid.uuid4()))
    runs: dict[str, dict[str, tuple[float, float, float]]] = {}
    for clock_name, timer in (("cpu", time.process_time), ("wall", time.perf_counter)):
        profiler = cProfile.Profile(timer)
        keys_ = [str(uuid.uuid4()) for _ in range(requests)]
        profiler.enable()
        for key in keys_:
            post(c, "/idem/", key)
        profiler.disable()
        entries = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        runs[clock_name] = {}
        for (filename, line, func), (_, calls, own, cumulative, _) in entries.items():
            if "idempotency_app" in filename:
                where = f"{Path(filename).name}:{line} {func}"
            else:
                where = _watched(filename, func)
            if where:
                runs[clock_name][where] = (calls / requests, own / requests, cumulative / requests)
    ranked = sorted(runs["cpu"], key=lambda w: -runs["cpu"][w][2])[:24]
    rows = []
    for where in ranked:
        calls, own, cumulative = runs["cpu"][where]
        wall = runs["wall"].get(where, (0.0, 0.0, 0.0))[2]
        rows.append(
            [
                where,
                f"{calls:g}",
                f"{own * 1e6:,.0f}",
                f"{cumulative * 1e6:,.0f}",
                f"{wall * 1e6:,.0f}",
            ]
        )
    headers = ["function (fresh request)", "calls/req", "own CPU us", "cum. CPU us", "cum. wall us"]
    return table(headers, rows) + (
        f"\n({requests} decorated fresh requests through the test client, per request; "
        "cProfile inflates Python-heavy rows)"
    )


def _watched(filename: str, func: str) -> str:
    """Library calls worth a row of their own: database and Redis waits."""
    if filename.endswith("psycopg/connection.py") and func in ("wait", "commit"):
        return f"psycopg {func}"
    if filename.endswith("MySQLdb/cursors.py") and func == "_query":
        return "mysqlclient query"
    if filename == "~" and "_mysql.connection" in func:  # a C method: commit, autocommit
        return "mysqlclient " + func.split("'")[1]
    if filename.endswith("django/db/backends/utils.py") and func == "execute":
        return "django cursor execute"
    if "redis" in filename and filename.endswith("client.py") and func == "execute_command":
        return "redis execute_command"
    if filename.endswith("django/db/transaction.py") and func in ("__enter__", "__exit__"):
        return f"transaction.atomic {func}"
    return ""


# ------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database",
        choices=["postgres", "mysql"],
        help="default: IDEMPOTENCY_BENCH_DB, else postgres (run.py passes its own on)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        help="records for the large-table claim figures (default 1M; 300k on MariaDB)",
    )
    parser.add_argument("--claims", type=int, default=2000, help="claims timed per cell")
    parser.add_argument(
        "--repeats", type=int, default=200, help="requests per batch for in-process timings"
    )
    parser.add_argument("--profile-requests", type=int, default=300)
    parser.add_argument(
        "--only",
        choices=[
            "roundtrips",
            "claims",
            "sequence",
            "fingerprint",
            "requests",
            "components",
            "phases",
            "profile",
        ],
        action="append",
    )
    args = parser.parse_args()
    if args.database:
        use_database(args.database)
    setup_django()
    reset_schema()
    print_machine(machine())
    mysql = vendor() == "mysql"
    rows = args.rows or (300_000 if mysql else 1_000_000)
    sections: list[tuple[str, str, Callable[[], str]]] = [
        ("roundtrips", "Round trips per request", round_trips),
        ("claims", "Claim latency by table size", lambda: claim_latency(rows, args.claims)),
        ("sequence", "Replay lookups and the id sequence", lambda: sequence_burn(args.claims)),
        ("fingerprint", "Fingerprint cost", fingerprint_cost),
        ("requests", "Time per request in process", lambda: per_request(args.repeats)),
        ("components", "What the pieces cost", components),
        ("phases", "Where a fresh request's CPU goes", lambda: phases(args.repeats * 10)),
        ("profile", "Profile of decorated fresh requests", lambda: profile(args.profile_requests)),
    ]
    for name, title, section in sections:
        if args.only and name not in args.only:
            continue
        if mysql and name == "sequence":
            print(
                f"## {title}\n\nPostgreSQL only: it compares two forms of PostgreSQL's claim statement.\n"
            )
            continue
        started = time.perf_counter()
        text = section()
        print(f"## {title}  ({time.perf_counter() - started:.0f} s)\n")
        print(text)
        print(flush=True)
    reset_schema()


if __name__ == "__main__":
    main()
