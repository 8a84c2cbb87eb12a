"""Load benchmark: gunicorn on PostgreSQL + Redis, three views side by side.

    .venv/bin/python -m benchmarks.run            # everything: load, then micro.py
    .venv/bin/python -m benchmarks.run --help

Starts gunicorn (gthread workers) on loopback with the bench project, then
drives it from separate client processes with keep-alive connections,
spread evenly over the workers and kept for the whole run, so every
scenario is served by the same connections. Each round runs every scenario
twice: "serial" (one connection: latency without queueing) and "loaded"
(all connections: throughput). The order of scenarios rotates per round;
ratios are taken within a round, then the median over rounds is reported.

Scenarios: floor (authenticate, return), plain (two writes in a
transaction), fresh (the same view under @idempotent, a new key per
request), replay (keys already completed), conflict (a slow request holds
a key in progress; the others hit that key and get 409). With --what-if, a
second gunicorn runs the simulated change and "fresh what-if" joins the
rounds, interleaved with the others.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    ROOT,
    load_average,
    machine,
    median,
    percentile,
    print_machine,
    reset_schema,
    setup_django,
    table,
)

HOST = "127.0.0.1"
TOKEN = "bench-token-1"
BODY = {"label": "bench", "amount": 100}
REPLAY_KEYS = 64
WHAT_IFS = ("async-claim", "no-savepoint")


@dataclass(frozen=True)
class Scenario:
    path: str
    status: int
    replayed: bool = False
    server: str = "shipped"


SCENARIOS = {
    "floor": Scenario("/floor/", 200),
    "plain": Scenario("/plain/", 201),
    "fresh": Scenario("/idem/", 201),
    "replay": Scenario("/idem/", 201, replayed=True),
    "conflict": Scenario("/idem/", 409),
}
WHAT_IF_SCENARIO = ("fresh what-if", Scenario("/idem/", 201, server="what-if"))


# ---------------------------------------------------------------- client side


@dataclass
class Cell:
    """One scenario for a fixed time, from one client process."""

    name: str
    scenario: Scenario
    phase: str
    start_at: float
    seconds: float
    body: bytes
    key_prefix: str = ""
    conflict_key: str = ""
    replay_keys: list[str] = field(default_factory=list)


@dataclass
class CellResult:
    latencies_ms: list[float]
    requests: int
    elapsed: float
    unexpected: Counter[str]


def _headers(key: str | None) -> dict[str, str]:
    headers = {"Authorization": f"Token {TOKEN}", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return headers


def _send(
    conn: http.client.HTTPConnection, path: str, body: bytes, key: str | None
) -> tuple[int, bool, bytes]:
    conn.request("POST", path, body, _headers(key))
    response = conn.getresponse()
    content = response.read()
    return response.status, response.getheader("Idempotent-Replayed") == "true", content


def balanced_connections(port: int, count: int, workers: int) -> list[http.client.HTTPConnection]:
    """``count`` keep-alive connections, as evenly spread over the workers as
    the accept order allows (whichever worker accepts first gets one)."""
    per_worker = -(-count // workers)
    kept: list[http.client.HTTPConnection] = []
    seen: Counter[int] = Counter()
    for _ in range(count * 20):
        if len(kept) == count:
            break
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        status, _, content = _send(conn, "/floor/", b"{}", None)
        if status != 200:
            raise RuntimeError(f"/floor/ answered {status}: {content[:200]!r}")
        pid = int(json.loads(content)["worker"])
        if seen[pid] < per_worker:
            seen[pid] += 1
            kept.append(conn)
        else:
            conn.close()
    while len(kept) < count:  # could not balance: take what comes
        kept.append(http.client.HTTPConnection(HOST, port, timeout=60))
    return kept


def _key(cell: Cell, index: int, n: int) -> str | None:
    if cell.scenario.path == "/idem/" and cell.conflict_key:
        return cell.conflict_key
    if cell.scenario.replayed:
        return cell.replay_keys[(index * 7 + n) % len(cell.replay_keys)]
    if cell.scenario.path == "/idem/":
        return f"{cell.key_prefix}-{index}-{n}"
    return None


def _drive(conn: http.client.HTTPConnection, index: int, cell: Cell, out: list[Any]) -> None:
    latencies: list[float] = []
    unexpected: Counter[str] = Counter()
    while time.time() < cell.start_at:
        time.sleep(0.0005)
    deadline = cell.start_at + cell.seconds
    started = time.perf_counter()
    n = 0
    while time.time() < deadline:
        key = _key(cell, index, n)
        t0 = time.perf_counter()
        try:
            status, replayed, _ = _send(conn, cell.scenario.path, cell.body, key)
        except (OSError, http.client.HTTPException) as exc:
            unexpected[type(exc).__name__] += 1
            conn.close()
            continue
        latencies.append((time.perf_counter() - t0) * 1000)
        if status != cell.scenario.status or replayed != cell.scenario.replayed:
            unexpected[f"{status}{' replayed' if replayed else ''}"] += 1
        n += 1
    out[index] = (latencies, n, time.perf_counter() - started, unexpected)


def client_process(
    ports: dict[str, int], connections: int, workers: int, commands: Any, results: Any
) -> None:
    """Holds its connections to every server for the whole run; runs the cells it is sent."""
    conns = {name: balanced_connections(port, connections, workers) for name, port in ports.items()}
    results.put("ready")
    while True:
        cell: Cell | None = commands.get()
        if cell is None:
            break
        active = conns[cell.scenario.server]
        active = active[:1] if cell.phase == "serial" else active
        out: list[Any] = [None] * len(active)
        threads = [
            threading.Thread(target=_drive, args=(conn, i, cell, out))
            for i, conn in enumerate(active)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        merged = CellResult([], 0, 0.0, Counter())
        for latencies, n, elapsed, unexpected in out:
            merged.latencies_ms.extend(latencies)
            merged.requests += n
            merged.elapsed = max(merged.elapsed, elapsed)
            merged.unexpected.update(unexpected)
        results.put(merged)
    for group in conns.values():
        for conn in group:
            conn.close()


# ---------------------------------------------------------------- server side


def ensure_installed() -> None:
    """gunicorn and psycopg come with the project's ``bench`` extra."""
    try:
        import gunicorn  # noqa: F401
        import psycopg  # noqa: F401
    except ImportError:
        print("Installing the bench extra into", sys.prefix)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[bench]"]
        subprocess.run(command, check=True)


class Server:
    """One gunicorn, stopped on exit; ``what_if`` names the simulated changes."""

    def __init__(self, args: argparse.Namespace, port: int, what_if: list[str]) -> None:
        self.port = port
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"idempotency-bench-{port}.log"
        command = [
            sys.executable, "-m", "gunicorn", "benchmarks.benchproject.wsgi:application",
            "--bind", f"{HOST}:{port}",
            "--workers", str(args.workers),
            "--worker-class", "gthread",
            "--threads", str(args.threads),
            "--keep-alive", "600",
            "--log-level", "warning",
        ]  # fmt: skip
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "benchmarks.benchproject.settings",
            "IDEMPOTENCY_BENCH_WHATIF": ",".join(what_if),
        }
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_ready()
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        self.pids = [int(p) for p in children.read_text().split()] if children.exists() else []

    def _wait_ready(self) -> None:
        for _ in range(200):
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited:\n{self.log.read_text()[-2000:]}")
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
                if _send(conn, "/floor/", b"{}", None)[0] == 200:
                    conn.close()
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gunicorn did not answer:\n{self.log.read_text()[-2000:]}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the workers, from /proc."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
        return total / ticks

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def seed_replays(port: int, prefix: str) -> list[str]:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    body = json.dumps(BODY).encode()
    keys = [f"{prefix}-replay-{i}" for i in range(REPLAY_KEYS)]
    for key in keys:
        status, _, content = _send(conn, "/idem/", body, key)
        if status != 201:
            raise RuntimeError(f"seeding replays: {status} {content[:200]!r}")
    conn.close()
    return keys


class Holder(AbstractContextManager["Holder"]):
    """A slow request that keeps ``key`` in progress while the cell runs."""

    def __init__(self, port: int, key: str, body: bytes) -> None:
        self.port, self.key, self.body = port, key, body
        self.status = 0
        self.thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=120)
        self.status = _send(conn, "/idem/", self.body, self.key)[0]
        conn.close()

    def __enter__(self) -> Holder:
        self.thread.start()
        time.sleep(0.2)
        conn = http.client.HTTPConnection(HOST, self.port, timeout=120)
        for _ in range(100):
            if _send(conn, "/idem/", self.body, self.key)[0] == 409:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the slow request never held its key")
        conn.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join()
        if self.status != 201:
            raise RuntimeError(f"the slow request ended with {self.status}")


# ---------------------------------------------------------------- the run


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = time.strftime("%H%M%S")
        self.scenarios = dict(SCENARIOS)
        self.servers = {"shipped": Server(args, args.port, [])}
        if args.what_if:
            self.scenarios[WHAT_IF_SCENARIO[0]] = WHAT_IF_SCENARIO[1]
            self.servers["what-if"] = Server(args, args.port + 1, args.what_if)
        self.replay_keys = seed_replays(args.port, self.run_id)
        ctx = mp.get_context("spawn")
        self.per_process = max(1, args.connections // args.processes)
        self.commands = [ctx.Queue() for _ in range(args.processes)]
        self.results = [ctx.Queue() for _ in range(args.processes)]
        ports = {name: server.port for name, server in self.servers.items()}
        self.clients = [
            ctx.Process(
                target=client_process,
                args=(ports, self.per_process, args.workers, self.commands[i], self.results[i]),
                daemon=True,
            )
            for i in range(args.processes)
        ]
        for client in self.clients:
            client.start()
        for queue in self.results:
            queue.get(timeout=60)

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for client in self.clients:
            client.join(timeout=10)
        for server in self.servers.values():
            server.stop()

    def measure(self, name: str, phase: str, r: int, seconds: float) -> dict[str, Any]:
        scenario = self.scenarios[name]
        server = self.servers[scenario.server]
        body = json.dumps(BODY).encode()
        holder: AbstractContextManager[Any] = nullcontext()
        conflict_key = ""
        if name == "conflict":
            conflict_key = f"{self.run_id}-conflict-{r}-{phase}"
            body = json.dumps({**BODY, "sleep": seconds + 1.5}).encode()
            holder = Holder(server.port, conflict_key, body)
        senders = range(1) if phase == "serial" else range(self.args.processes)
        with holder:
            cell = Cell(name, scenario, phase, time.time() + 0.3, seconds, body)
            cell.conflict_key, cell.replay_keys = conflict_key, self.replay_keys
            cpu_before = server.cpu_seconds()
            for i in senders:
                prefix = f"{self.run_id}-{name}-{r}-{phase}-{i}"
                self.commands[i].put(replace(cell, key_prefix=prefix))
            parts: list[CellResult] = [self.results[i].get(timeout=seconds + 120) for i in senders]
            cpu_used = server.cpu_seconds() - cpu_before
        latencies = [x for p in parts for x in p.latencies_ms]
        requests = sum(p.requests for p in parts)
        unexpected: Counter[str] = Counter()
        for p in parts:
            unexpected.update(p.unexpected)
        return {
            "round": r,
            "scenario": name,
            "phase": phase,
            "requests": requests,
            "rps": requests / max(p.elapsed for p in parts),
            "p50": percentile(latencies, 0.50),
            "p99": percentile(latencies, 0.99),
            "cpu_us": cpu_used / max(1, requests) * 1e6,
            "unexpected": dict(unexpected),
        }

    def rounds(self) -> list[dict[str, Any]]:
        names = list(self.scenarios)
        for name in names:  # warm-up, not recorded: imports, connections, caches
            self.measure(name, "loaded", -1, 0.5)
        cells = []
        for r in range(self.args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                for phase in ("serial", "loaded"):
                    cells.append(self.measure(name, phase, r, self.args.seconds))
            print(f"round {r + 1}/{self.args.rounds} done", flush=True)
        return cells


def run(args: argparse.Namespace) -> dict[str, Any]:
    ensure_installed()
    setup_django()
    reset_schema()
    notes = machine()
    from django.db import connection

    connection.close()
    print_machine(notes)
    print(
        f"{args.rounds} rounds x (serial + loaded), {args.seconds:g} s per cell; "
        f"gunicorn {args.workers} gthread workers x {args.threads} threads; "
        f"{args.processes} client processes, {args.connections} connections when loaded; "
        f"what-if: {', '.join(args.what_if) or 'none'}\n"
    )
    bench = Bench(args)
    try:
        cells = bench.rounds()
    finally:
        bench.close()
    notes["load after"] = load_average()
    return {
        "machine": notes,
        "args": vars(args),
        "scenarios": list(bench.scenarios),
        "cells": cells,
    }


def summarize(data: dict[str, Any]) -> str:
    cells = data["cells"]
    rounds = sorted({c["round"] for c in cells})
    index = {(c["round"], c["scenario"], c["phase"]): c for c in cells}

    def per_round(a: str, b: str, phase: str, what: str = "rps") -> float:
        if what == "p50":
            return median([index[r, a, phase]["p50"] - index[r, b, phase]["p50"] for r in rounds])
        return median([index[r, a, phase]["rps"] / index[r, b, phase]["rps"] for r in rounds])

    lines = []
    for phase in ("serial", "loaded"):
        rows = []
        for name in data["scenarios"]:
            mine = [index[r, name, phase] for r in rounds]
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
                    f"{per_round(name, 'plain', phase):.2f}x",
                    f"{per_round(name, 'floor', phase):.2f}x",
                    ", ".join(f"{k}: {v}" for k, v in bad.items()) or "none",
                ]
            )
        connections = "1 connection" if phase == "serial" else "all connections"
        lines.append(f"{phase} ({connections}), medians over {len(rounds)} rounds")
        headers = ["scenario", "req/s", "p50 ms", "p99 ms", "worker CPU us/req"]
        headers += ["vs plain", "vs floor", "unexpected"]
        lines += [table(headers, rows), ""]

    fresh = ["fresh"] + (["fresh what-if"] if "fresh what-if" in data["scenarios"] else [])
    checks: list[tuple[str, float, str]] = []
    for name in fresh:
        checks.append(
            (f"{name} / plain, req/s loaded", per_round(name, "plain", "loaded"), ">= 0.90x")
        )
    checks.append(
        ("replay / floor, req/s loaded", per_round("replay", "floor", "loaded"), ">= 0.85x")
    )
    for name in fresh:
        for phase in ("serial", "loaded"):
            added = per_round(name, "plain", phase, "p50")
            checks.append((f"{name} - plain, p50 {phase}", added, "< 0.3 ms"))
    checks.append(("replay - floor, p50 serial", per_round("replay", "floor", "serial", "p50"), ""))
    checks.append(("conflict / floor, req/s loaded", per_round("conflict", "floor", "loaded"), ""))
    rows = []
    for measure, value, target in checks:
        shown = f"{value:+.3f} ms" if "p50" in measure else f"{value:.2f}x"
        met = "-"
        if target.startswith(">="):
            met = "yes" if value >= float(target[3:-1]) else "NO"
        elif target.startswith("<"):
            met = "yes" if value < float(target[2:-3]) else "NO"
        rows.append([measure, shown, target or "(none)", met])
    lines.append("Targets (ratios and differences taken per round, median over rounds)")
    lines.append(table(["measure", "measured", "target", "met"], rows))
    notes = data["machine"]
    lines.append(f"\nload average before: {notes['load']}; after: {notes['load after']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each cell")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=5, help="gthread threads per worker")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--connections", type=int, default=8, help="loaded connections, in all")
    parser.add_argument("--port", type=int, default=8731, help="the what-if server takes port + 1")
    parser.add_argument("--json", type=Path, help="also write every cell's figures here")
    parser.add_argument(
        "--what-if",
        action="append",
        default=[],
        choices=WHAT_IFS,
        help="also measure a simulated change (see benchmarks/benchproject/whatif.py)",
    )
    parser.add_argument("--skip-micro", action="store_true", help="do not run micro.py afterwards")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
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
