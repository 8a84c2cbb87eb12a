"""Load benchmark: gunicorn on PostgreSQL or MariaDB + Redis, three views side by side.

    .venv/bin/python -m benchmarks.run                     # PostgreSQL: load, then micro.py
    .venv/bin/python -m benchmarks.run --database mysql    # the same on MariaDB
    .venv/bin/python -m benchmarks.run --baseline /tmp/base   # A/B against another checkout
    .venv/bin/python -m benchmarks.run --help

Starts gunicorn (gthread workers) on loopback with the bench project, then
drives it from separate client processes with keep-alive connections (see
``load.py``). Each round runs every scenario twice: "serial" (one
connection: latency without queueing) and "loaded" (all connections:
throughput). The order of scenarios rotates per round; ratios are taken
within a round, then the median over rounds is reported.

Scenarios: floor (authenticate, return), plain (two writes in a
transaction), fresh (the same view under @idempotent, a new key per
request), replay (keys already completed), conflict (a slow request holds
a key in progress; the others hit that key and get 409).

With ``--baseline DIR`` a second gunicorn imports ``idempotency_app`` from
DIR (a checkout of an earlier commit: ``git worktree add /tmp/base <rev>``)
and "fresh @base", "replay @base" and "conflict @base" join the rounds,
interleaved with the others, so that a change to the library is measured
against its predecessor in the same run, on the same machine state. Both
servers share the database, migrated by this checkout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    ROOT,
    load_average,
    median,
    table,
    use_database,
)
from benchmarks.load import (
    BODY,
    CONFLICT,
    FLOOR,
    FRESH,
    PLAIN,
    REPLAY,
    Cell,
    Fleet,
    Holder,
    Scenario,
    Server,
    prepare,
    rotated,
    seed_replays,
)

CURRENT, BASELINE = "current", "baseline"
BASE_SUFFIX = " @base"
MIN_ROUNDS = 5  # the targets are medians of at least this many rounds


@dataclass(frozen=True)
class Measured:
    """A scenario served by one of the servers."""

    scenario: Scenario
    server: str = CURRENT


SCENARIOS = {
    "floor": Measured(FLOOR),
    "plain": Measured(PLAIN),
    "fresh": Measured(FRESH),
    "replay": Measured(REPLAY),
    "conflict": Measured(CONFLICT),
}
# What the library changes; the floor and the undecorated view do not use it.
LIBRARY_SCENARIOS = ("fresh", "replay", "conflict")


class Bench(Fleet):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = time.strftime("%H%M%S")
        self.scenarios = dict(SCENARIOS)
        servers = {CURRENT: Server(args.port, args.workers, args.threads)}
        self.replay_keys = {CURRENT: seed_replays(args.port, f"{self.run_id}-{CURRENT}")}
        if args.baseline:
            server = Server(args.port + 1, args.workers, args.threads, library=args.baseline)
            servers[BASELINE] = server
            self.replay_keys[BASELINE] = seed_replays(server.port, f"{self.run_id}-{BASELINE}")
            for name in LIBRARY_SCENARIOS:
                self.scenarios[name + BASE_SUFFIX] = Measured(SCENARIOS[name].scenario, BASELINE)
        for name, server in servers.items():
            print(f"{name} server (port {server.port}) runs {server.library}")
        print(flush=True)
        super().__init__(servers, args.processes, args.connections)

    def measure(self, name: str, phase: str, r: int, seconds: float) -> dict[str, Any]:
        measured = self.scenarios[name]
        server = self.servers[measured.server]
        body = json.dumps(BODY).encode()
        holder: AbstractContextManager[Any] = nullcontext()
        conflict_key = ""
        if measured.scenario is CONFLICT:
            conflict_key = f"{self.run_id}-{measured.server}-conflict-{r}-{phase}"
            body = json.dumps({**BODY, "sleep": seconds + 1.5}).encode()
            holder = Holder(server.port, conflict_key, body)
        serial = phase == "serial"
        with holder:
            cell = Cell(
                measured.scenario,
                (measured.server,),
                1 if serial else self.clients.per_process,
                time.time() + 0.3,
                seconds,
                body,
                key_prefix=f"{self.run_id}-{measured.server}-{name}-{r}-{phase}",
                conflict_key=conflict_key,
                replay_keys=self.replay_keys[measured.server],
            )
            figures = self.clients.run(cell, 1 if serial else self.clients.processes, [server])
        return {"round": r, "scenario": name, "phase": phase, **figures}

    def rounds(self) -> list[dict[str, Any]]:
        names = list(self.scenarios)
        for name in names:  # warm-up, not recorded: imports, connections, caches
            self.measure(name, "loaded", -1, 0.5)
        cells = []
        for r in range(self.args.rounds):
            for name in rotated(names, r):
                for phase in ("serial", "loaded"):
                    cells.append(self.measure(name, phase, r, self.args.seconds))
            print(f"round {r + 1}/{self.args.rounds} done", flush=True)
        return cells


def run(args: argparse.Namespace) -> dict[str, Any]:
    notes = prepare()
    print(
        f"{args.rounds} rounds x (serial + loaded), {args.seconds:g} s per cell; "
        f"gunicorn {args.workers} gthread workers x {args.threads} threads; "
        f"{args.processes} client processes, {args.connections} connections when loaded; "
        f"baseline: {args.baseline or 'none'}\n"
    )
    bench = Bench(args)
    try:
        cells = bench.rounds()
    finally:
        bench.close()
    notes["load after"] = load_average()
    notes["servers"] = "; ".join(
        f"{name}: {server.library}" for name, server in bench.servers.items()
    )
    return {
        "machine": notes,
        "args": {**vars(args), "baseline": str(args.baseline or "")},
        "scenarios": list(bench.scenarios),
        "cells": cells,
    }


class Rounds:
    """The cells of a run, indexed, with comparisons taken inside each round."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.rounds = sorted({c["round"] for c in data["cells"]})
        self.index = {(c["round"], c["scenario"], c["phase"]): c for c in data["cells"]}

    def cells(self, name: str, phase: str) -> list[dict[str, Any]]:
        return [self.index[r, name, phase] for r in self.rounds]

    def ratio(self, a: str, b: str, phase: str) -> float:
        """Median over rounds of a's throughput over b's, in the same round."""
        return median([x["rps"] / y["rps"] for x, y in zip(*self._pair(a, b, phase), strict=True)])

    def added(self, a: str, b: str, phase: str) -> float:
        """Median over rounds of a's p50 minus b's, in the same round (ms)."""
        return median([x["p50"] - y["p50"] for x, y in zip(*self._pair(a, b, phase), strict=True)])

    def _pair(
        self, a: str, b: str, phase: str
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return self.cells(a, phase), self.cells(b, phase)


def targets(data: dict[str, Any], rounds: Rounds) -> list[list[str]]:
    """The issue's targets, for this checkout and the baseline if any: fresh
    >= 0.85x the undecorated view (loaded and serial), added p50 <= 0.5 ms
    serial, replay and conflict >= 1.3x the undecorated view."""
    rows: list[list[str]] = []
    suffixes = [""] + ([BASE_SUFFIX] if "fresh" + BASE_SUFFIX in data["scenarios"] else [])

    def ratio_row(name: str, phase: str, target: float) -> None:
        value = rounds.ratio(name, "plain", phase)
        met = "met" if value >= target else "NO"
        rows.append([f"{name} / plain, req/s {phase}", f"{value:.2f}x", f">= {target}x", met])

    for suffix in suffixes:
        for phase in ("loaded", "serial"):
            ratio_row("fresh" + suffix, phase, 0.85)
        added = rounds.added("fresh" + suffix, "plain", "serial")
        met = "met" if added <= 0.5 else "NO"
        rows.append([f"fresh{suffix} - plain, p50 serial", f"{added:+.3f} ms", "<= 0.5 ms", met])
        for name in ("replay", "conflict"):
            for phase in ("loaded", "serial"):
                ratio_row(name + suffix, phase, 1.3)
    if len(suffixes) > 1:  # the A/B itself: this checkout against the baseline
        for name in LIBRARY_SCENARIOS:
            for phase in ("loaded", "serial"):
                value = rounds.ratio(name, name + BASE_SUFFIX, phase)
                rows.append(
                    [f"{name} / {name}{BASE_SUFFIX}, req/s {phase}", f"{value:.2f}x", "", "-"]
                )
            value = rounds.added(name, name + BASE_SUFFIX, "serial")
            rows.append([f"{name} - {name}{BASE_SUFFIX}, p50 serial", f"{value:+.3f} ms", "", "-"])
    return rows


def summarize(data: dict[str, Any]) -> str:
    rounds = Rounds(data)
    lines = []
    for phase in ("serial", "loaded"):
        rows = []
        for name in data["scenarios"]:
            mine = rounds.cells(name, phase)
            bad: Counter[str] = Counter()
            for c in mine:
                bad.update(c["unexpected"])
            rows.append(
                [
                    name,
                    f"{median([c['rps'] for c in mine]):,.0f}",
                    f"{median([c['p50'] for c in mine]):.2f}",
                    f"{median([c['p99'] for c in mine]):.2f}",
                    f"{median([c['cpu_us'] for c in mine]):,.0f}",
                    f"{rounds.ratio(name, 'plain', phase):.2f}x",
                    f"{rounds.ratio(name, 'floor', phase):.2f}x",
                    ", ".join(f"{k}: {v}" for k, v in bad.items()) or "none",
                ]
            )
        connections = "1 connection" if phase == "serial" else "all connections"
        lines.append(f"{phase} ({connections}), medians over {len(rounds.rounds)} rounds")
        headers = ["scenario", "req/s", "p50 ms", "p99 ms", "worker CPU us/req"]
        headers += ["vs plain", "vs floor", "unexpected"]
        lines += [table(headers, rows), ""]

    lines.append("Targets (ratios and differences taken per round, median over rounds)")
    lines.append(table(["measure", "measured", "target", "met"], targets(data, rounds)))
    if len(rounds.rounds) < MIN_ROUNDS:
        lines.append(
            f"Only {len(rounds.rounds)} round(s): the targets are judged on medians of at "
            f"least {MIN_ROUNDS}, so these verdicts are indicative only."
        )
    notes = data["machine"]
    lines.append(f"\nload average before: {notes['load']}; after: {notes['load after']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--database",
        choices=["postgres", "mysql"],
        default="postgres",
        help="postgres (127.0.0.1:5432) or mysql, i.e. MariaDB (127.0.0.1:3306)",
    )
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each cell")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=5, help="gthread threads per worker")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--connections", type=int, default=8, help="loaded connections, in all")
    parser.add_argument("--port", type=int, default=8731, help="the baseline server takes port + 1")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="a checkout whose idempotency_app a second server runs, measured in the same rounds",
    )
    parser.add_argument("--json", type=Path, help="also write every cell's figures here")
    parser.add_argument("--skip-micro", action="store_true", help="do not run micro.py afterwards")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.baseline and not (args.baseline / "idempotency_app" / "__init__.py").exists():
        parser.error(f"--baseline {args.baseline}: no idempotency_app package there")
    use_database(args.database)
    data = run(args)
    print()
    print(summarize(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))
    if not args.skip_micro:
        print(flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.micro"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
