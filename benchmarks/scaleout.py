"""Scale-out: several gunicorn instances on one database and one Redis.

    .venv/bin/python -m benchmarks.scaleout                        # 1, 2, 4 instances
    .venv/bin/python -m benchmarks.scaleout --database mysql
    .venv/bin/python -m benchmarks.scaleout --instances 1 2 --rounds 1 --seconds 1   # smoke

The library scales out the way its users' apps do: many app servers, each
with its own processes, sharing one database (the arbiter of every key)
and one Redis. This starts the largest number of instances asked for once,
each a gunicorn of its own on its own port, then per round measures fresh
and plain requests with their keys spread over the first 1, 2, 4 ...
instances (the idle ones cost nothing), in an order that rotates per round:
throughput against one instance, the decorated view against the
undecorated one at the same instance count, and worker CPU per request.

Then a race among instances: every key is sent to every instance at once
(``--race-copies`` requests per instance), and each key must have run its
view exactly once. The view writes one Charge row per execution, labelled
with the key, so duplicates are counted in the database, not inferred from
status codes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    load_average,
    median,
    table,
    use_database,
)
from benchmarks.load import (
    BODY,
    FRESH,
    HOST,
    PLAIN,
    Cell,
    Fleet,
    Server,
    prepare,
    rotated,
    send,
)

SCENARIOS = {"fresh": FRESH, "plain": PLAIN}


def bound_note(cores: int, instances: int, workers: int, processes: int) -> str:
    """Why throughput cannot grow with instances here: say it with the figures."""
    return (
        f"This machine has {cores} cores, shared by up to {instances * workers} gunicorn "
        f"workers, {processes} client processes, the database and Redis: more instances "
        "add no CPU, so throughput against one instance measures what the instances cost "
        "each other on one machine (the shared database, contention), not the scaling of "
        "a fleet with a machine per instance. Worker CPU per request and the race's "
        "duplicates are the figures that carry over."
    )


class ScaleOut(Fleet):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = time.strftime("%H%M%S")
        most = max(args.instances)
        servers = {f"i{i}": Server(args.port + i, args.workers, args.threads) for i in range(most)}
        self.names = list(servers)
        super().__init__(servers, args.processes, args.connections)

    def measure(self, name: str, count: int, r: int, seconds: float) -> dict[str, Any]:
        used = self.names[:count]
        cell = Cell(
            SCENARIOS[name],
            tuple(used),
            self.clients.per_process,
            time.time() + 0.3,
            seconds,
            json.dumps(BODY).encode(),
            key_prefix=f"{self.run_id}-{name}-{count}-{r}",
        )
        workers = [self.servers[n] for n in used]
        figures = self.clients.run(cell, self.clients.processes, workers)
        return {"round": r, "scenario": name, "instances": count, **figures}

    def rounds(self) -> list[dict[str, Any]]:
        counts = list(self.args.instances)
        for count in counts:  # warm-up, not recorded
            for name in SCENARIOS:
                self.measure(name, count, -1, 0.5)
        cells = []
        for r in range(self.args.rounds):
            for count in rotated(counts, r):
                for name in SCENARIOS:
                    cells.append(self.measure(name, count, r, self.args.seconds))
            print(f"round {r + 1}/{self.args.rounds} done", flush=True)
        return cells

    def race(self, count: int) -> list[str]:
        """Every key sent to each of the first ``count`` instances at once;
        the outcomes, and the Charge rows per key from the database."""
        from django.db import connection
        from django.db.models import Count

        from benchmarks.benchproject.models import Charge

        prefix = f"race-{self.run_id}-{count}"
        keys = [f"{prefix}-{i}" for i in range(self.args.race_keys)]
        senders = [
            self.servers[name] for name in self.names[:count] for _ in range(self.args.race_copies)
        ]
        barrier = threading.Barrier(len(senders))
        outcomes: Counter[str] = Counter()
        executions: Counter[str] = Counter()
        lock = threading.Lock()

        def sender(server: Server) -> None:
            conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
            for key in keys:
                body = json.dumps({**BODY, "label": key}).encode()
                barrier.wait()
                try:
                    status, replayed, _ = send(conn, "/idem/", body, key)
                except (OSError, http.client.HTTPException) as exc:
                    status, replayed = 0, False
                    conn.close()
                    with lock:
                        outcomes[type(exc).__name__] += 1
                    continue
                with lock:
                    outcomes[f"{status}{' replayed' if replayed else ''}"] += 1
                    if status == 201 and not replayed:
                        executions[key] += 1
            conn.close()

        threads = [threading.Thread(target=sender, args=(server,)) for server in senders]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
        charges = dict(
            Charge.objects.filter(label__startswith=f"{prefix}-")
            .values_list("label")
            .annotate(n=Count("id"))
        )
        connection.close()
        rows_per_key = Counter(charges.get(key, 0) for key in keys)
        duplicates = sum(n for c, n in rows_per_key.items() if c > 1)
        disagree = sum(1 for key in keys if charges.get(key, 0) != executions[key])
        return [
            f"{count} instances x {self.args.race_copies} copies",
            f"{len(keys)}",
            f"{len(keys) * len(senders)}",
            ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())),
            ", ".join(f"{c}: {n}" for c, n in sorted(rows_per_key.items())),
            f"{duplicates}" + ("" if duplicates == 0 else " (MUST BE 0)"),
            f"{disagree}",
            f"{elapsed:.1f}",
        ]


def summarize(cells: list[dict[str, Any]], counts: list[int]) -> str:
    rounds = sorted({c["round"] for c in cells})
    index = {(c["round"], c["scenario"], c["instances"]): c for c in cells}
    one = counts[0]
    rows = []
    for name in SCENARIOS:
        for count in counts:
            mine = [index[r, name, count] for r in rounds]
            bad: Counter[str] = Counter()
            for c in mine:
                bad.update(c["unexpected"])
            against_one = median(
                [index[r, name, count]["rps"] / index[r, name, one]["rps"] for r in rounds]
            )
            against_plain = median(
                [index[r, name, count]["rps"] / index[r, "plain", count]["rps"] for r in rounds]
            )
            rows.append(
                [
                    name,
                    str(count),
                    f"{median([c['rps'] for c in mine]):,.0f}",
                    f"{against_one:.2f}x",
                    f"{against_plain:.2f}x",
                    f"{median([c['p50'] for c in mine]):.2f}",
                    f"{median([c['p99'] for c in mine]):.2f}",
                    f"{median([c['cpu_us'] for c in mine]):,.0f}",
                    ", ".join(f"{k}: {v}" for k, v in bad.items()) or "none",
                ]
            )
    headers = [
        "scenario",
        "instances",
        "req/s",
        f"vs {one} instance{'s' if one > 1 else ''}",
        "vs plain",
    ]
    headers += ["p50 ms", "p99 ms", "worker CPU us/req", "unexpected"]
    return f"Loaded, medians over {len(rounds)} rounds (ratios per round)\n" + table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database", choices=["postgres", "mysql"], default="postgres")
    parser.add_argument(
        "--instances", type=int, nargs="+", default=[1, 2, 4], help="instance counts compared"
    )
    parser.add_argument("--workers", type=int, default=1, help="gunicorn workers per instance")
    parser.add_argument("--threads", type=int, default=5, help="gthread threads per worker")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument(
        "--connections", type=int, default=4, help="connections per instance, in all processes"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each cell")
    parser.add_argument("--race-keys", type=int, default=200, help="keys raced among instances")
    parser.add_argument("--race-copies", type=int, default=2, help="requests per instance per key")
    parser.add_argument("--port", type=int, default=8741, help="instances take port, port + 1 ...")
    args = parser.parse_args()
    if args.rounds < 1 or min(args.instances) < 1:
        parser.error("--rounds and --instances must be at least 1")
    args.instances = sorted(set(args.instances))
    use_database(args.database)
    notes = prepare()
    cores = os.cpu_count() or 1
    note = bound_note(cores, max(args.instances), args.workers, args.processes)
    print(
        f"instances {', '.join(map(str, args.instances))}; each gunicorn {args.workers} "
        f"gthread worker(s) x {args.threads} threads; {args.connections} connections per "
        f"instance from {args.processes} client processes; {args.rounds} rounds of "
        f"{args.seconds:g} s cells\n\n{note}\n",
        flush=True,
    )
    bench = ScaleOut(args)
    try:
        cells = bench.rounds()
        races = [bench.race(count) for count in args.instances if count > 1]
    finally:
        bench.close()
    print()
    print(summarize(cells, args.instances))
    print("\nRace among instances: each key sent to every instance at once")
    headers = ["race", "keys", "requests", "answers", "Charge rows per key: keys"]
    headers += ["duplicates", "keys where rows != fresh 201s", "seconds"]
    print(table(headers, races) if races else "(needs at least 2 instances)")
    print(f"\n{note}")
    print(f"\nload average before: {notes['load']}; after: {load_average()}")


if __name__ == "__main__":
    main()
