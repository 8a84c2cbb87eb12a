"""Instructions a request costs the app server's process, counted by valgrind.

    .venv/bin/python -m benchmarks.instructions                     # PostgreSQL
    .venv/bin/python -m benchmarks.instructions --baseline /tmp/base  # and another checkout
    .venv/bin/python -m benchmarks.instructions --database mysql

Time per request on a shared or virtual machine moves by a third between
runs of the same code (a process woken after each round trip runs on cold
caches), which hides any change smaller than that. The count of
instructions the process executes does not move: it is the worker CPU a
request costs, without the machine's noise. Each scenario runs in a child
process under ``valgrind --tool=cachegrind``, once with no timed requests
and once with ``--requests`` of them, after the same warm-up; the difference
per request is the figure. Requests go through Django's test client, in
process, against the bench project on PostgreSQL or MariaDB + Redis. What
the database server spends is not counted (``micro.py`` and ``peers.py``
time it). Needs valgrind (Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    AUTH,
    BODY,
    ROOT,
    SETTINGS,
    git_describe,
    library_shim,
    machine,
    print_machine,
    reset_schema,
    setup_django,
    table,
    use_database,
    vendor,
)

# The view's block as atomic(savepoint=False): what its savepoint costs.
NO_SAVEPOINT = "fresh, the view's atomic(savepoint=False)"
# Scenario: (path, what the key is, settings module).
SCENARIOS = {
    "floor": ("/floor/", None, SETTINGS),
    "plain": ("/plain/", None, SETTINGS),
    "fresh": ("/idem/", "new", SETTINGS),
    NO_SAVEPOINT: ("/idem/", "new", SETTINGS),
    "replay": ("/idem/", "replay", SETTINGS),
    "replay, REPLAY_CACHE": ("/idem/", "replay", "benchmarks.benchproject.replay_cache_settings"),
    # Authentication, the body read and hashed with the principal and the
    # key, the stored bytes sent: the least a replay held in memory does.
    "the least replay in memory": ("/least-replay/", "replay", SETTINGS),
    "conflict": ("/idem/", "held", SETTINGS),
}
# The pieces a keyed request is made of, each called alone (this checkout only).
PIECES = (
    "SELECT 1 through Django's cursor",
    "the same with 10 parameters",
    "SELECT 1 through libpq's own call (PostgreSQL)",
    "an empty transaction.atomic()",
    "the store's claim of a new key (its statement)",
    "the claim of a new key, in full (lifecycle.claims.claim)",
)
WARM_UP = 20


def piece(name: str) -> Callable[[], Any]:
    """One of ``PIECES``, as a call."""
    from django.db import connection, transaction

    from idempotency_app import store
    from idempotency_app.lifecycle.claims import Policy, claim
    from idempotency_app.store import Identity

    def select(sql: str, params: list[Any] | None = None) -> Callable[[], Any]:
        def call() -> Any:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                return cursor.fetchone()

        return call

    def atomic() -> None:
        with transaction.atomic():
            pass

    def new_identity() -> Identity:
        return Identity("user:1", str(uuid.uuid4()), "POST idem/", "f" * 64)

    policy = Policy.from_settings()
    connection.ensure_connection()
    return {
        PIECES[0]: select("SELECT 1"),
        PIECES[1]: select(", ".join(["SELECT %s"] + ["%s"] * 9), ["text"] * 5 + [1.5] * 5),
        PIECES[2]: lambda: connection.connection.pgconn.exec_(b"SELECT 1"),
        PIECES[3]: atomic,
        PIECES[4]: lambda: store.backend("default").claim(new_identity(), "token", 3600, 60),
        PIECES[5]: lambda: claim(new_identity(), policy),
    }[name]


def child(scenario: str, requests: int) -> None:
    """Warm every path up, then send ``requests`` of ``scenario`` (or make
    as many calls of a piece)."""
    from benchmarks.micro import hold_in_progress

    if scenario in PIECES:
        setup_django()
        call = piece(scenario)
        for _ in range(WARM_UP):
            call()
        gc.collect()
        gc.freeze()
        for _ in range(requests):
            call()
        return

    path, key_kind, settings = SCENARIOS[scenario]
    setup_django(settings)
    from benchmarks.benchproject import views

    views.SAVEPOINT = scenario != NO_SAVEPOINT
    from django.test import Client

    client = Client(**AUTH)
    replay_key, held_key = f"replay-{uuid.uuid4()}", f"held-{uuid.uuid4()}"

    def send(path: str, key_kind: str | None) -> None:
        extra: dict[str, Any] = {}
        if key_kind is not None:
            key = {"replay": replay_key, "held": held_key}.get(key_kind) or str(uuid.uuid4())
            extra["HTTP_IDEMPOTENCY_KEY"] = key
        client.post(path, BODY, content_type="application/json", **extra)

    send("/idem/", "replay")
    send("/idem/", "held")
    hold_in_progress(held_key)
    for _ in range(2):
        for other_path, other_key, _ in SCENARIOS.values():
            for _ in range(WARM_UP):
                send(other_path, other_key)
    # The collector's full passes read the whole heap, Django's included, at
    # moments that differ between the two runs: frozen, a pass reads what
    # the requests allocated, and the counts repeat.
    gc.collect()
    gc.freeze()
    for _ in range(requests):
        send(path, key_kind)


def count(checkout: Path, scenario: str, requests: int) -> int:
    """Instructions of a child process running ``scenario``."""
    shim = library_shim(checkout)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([shim.name, str(ROOT)]),
        # A fixed string hash: set and dict orders, and so the counts, repeat
        # from run to run (a random one moves them by tens of thousands).
        "PYTHONHASHSEED": "0",
        # Under valgrind the warm-up alone outlasts the default 5 seconds:
        # the timed replays would read the record again.
        "IDEMPOTENCY_BENCH_REPLAY_CACHE": "60",
    }
    command = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        "-m",  # from the shim's directory: its library first on the path
        "benchmarks.instructions",
        "--child",
        scenario,
        str(requests),
    ]
    with shim:
        done = subprocess.run(command, cwd=shim.name, env=env, capture_output=True, text=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{scenario} on {checkout} failed:\n{done.stderr[-3000:]}")
    return int(found.group(1).replace(",", ""))


def per_request(checkout: Path, scenario: str, requests: int) -> float:
    with ThreadPoolExecutor(2) as pool:  # the two runs share no state: one per core
        idle, busy = pool.map(lambda n: count(checkout, scenario, n), (0, requests))
    return (busy - idle) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=["postgres", "mysql"])
    parser.add_argument("--requests", type=int, default=200, help="timed requests per scenario")
    parser.add_argument("--baseline", type=Path, help="a checkout of the library to compare")
    parser.add_argument(
        "--child", nargs=2, metavar=("SCENARIO", "REQUESTS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind).")
    if args.database:
        use_database(args.database)
    setup_django()
    reset_schema()
    print_machine(machine())
    checkouts = [("now", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    for name, checkout in checkouts:
        print(f"{name}: {checkout} at {git_describe(checkout)}")
    figures = {
        (name, scenario): per_request(checkout, scenario, args.requests)
        for name, checkout in checkouts
        for scenario in SCENARIOS
    }
    reset_schema()
    headers = ["scenario"] + [f"{name}, k instr." for name, _ in checkouts]
    if args.baseline:
        headers.append("now / baseline")
    rows = []
    for scenario in SCENARIOS:
        row = [scenario] + [f"{figures[(name, scenario)] / 1000:,.0f}" for name, _ in checkouts]
        if args.baseline:
            row.append(f"{figures[('now', scenario)] / figures[('baseline', scenario)]:.3f}")
        rows.append(row)
    for label, more, less in (
        ("fresh - plain", "fresh", "plain"),
        ("replay - floor", "replay", "floor"),
        ("replay, REPLAY_CACHE - floor", "replay, REPLAY_CACHE", "floor"),
        ("the least replay in memory - floor", "the least replay in memory", "floor"),
    ):
        row = [label] + [
            f"{(figures[(name, more)] - figures[(name, less)]) / 1000:+,.0f}"
            for name, _ in checkouts
        ]
        if args.baseline:
            now, before = (figures[(n, more)] - figures[(n, less)] for n in ("now", "baseline"))
            row.append(f"{now / before:.3f}")
        rows.append(row)
    print()
    print(table(headers, rows))
    print(
        f"\n(client process only, {args.requests} requests per scenario, thousands of instructions)"
    )
    pieces = [p for p in PIECES if vendor() == "postgresql" or "PostgreSQL" not in p]
    rows = [[p, f"{per_request(ROOT, p, args.requests) / 1000:,.0f}"] for p in pieces]
    reset_schema()
    print()
    print(table(["piece, called alone (this checkout)", "k instr. per call"], rows))


if __name__ == "__main__":
    main()
