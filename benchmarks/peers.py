"""Peer bench: our ``@idempotent`` against drf-idempotency 1.0 (Redis backend), one run.

    .venv/bin/python -m benchmarks.peers                          # 5 rounds, 3 s cells
    .venv/bin/python -m benchmarks.peers --rounds 1 --seconds 2   # smoke
    .venv/bin/python -m benchmarks.peers --baseline /tmp/base     # and an earlier checkout of ours

The question is what each library adds to the same write view, so both are
measured in the same rounds, on the same machine state, with the same
clients (``load.py``): one gunicorn per library, each with 4 sync workers
(gunicorn's default worker; it closes the connection after each
response, so every request opens one), on PostgreSQL + Redis. Per server and
round: floor (authentication only), plain (the undecorated write view),
fresh (the view under the library, a new key per request) and replay
(retries of completed keys), each at one connection and loaded. Ratios
(fresh/plain, replay/floor) and the worker CPU a fresh request adds over
plain are taken within a round and on the same server, then the median over
rounds is reported. Then a race per library: every key sent by several
clients at once; the Charge rows per key say how often the view really ran.

The peer runs through its middleware (``benchproject/peer_settings.py``;
``peer_urls.py`` says why not its decorator), with its Redis backend.
The peer is pip-installed (``--no-deps``) into a directory of its own under
the system temp dir and put on its server's path only: it pins Django < 5.3
and must never become a dependency of this package or of its venv.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from operator import sub, truediv
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, git_describe, load_average, median, table, use_database
from benchmarks.load import (
    BODY,
    FLOOR,
    FRESH,
    HOST,
    PLAIN,
    REPLAY,
    Cell,
    Fleet,
    Server,
    prepare,
    rotated,
    seed_replays,
    send,
)

PEER = "drf-idempotency==1.0.0"
PEER_SETTINGS = "benchmarks.benchproject.peer_settings"
OURS, CACHED, PEER_NAME, BASE = "ours", "ours+cache", "peer", "base"
CACHED_SETTINGS = "benchmarks.benchproject.replay_cache_settings"
SCENARIOS = {"floor": FLOOR, "plain": PLAIN, "fresh": FRESH, "replay": REPLAY}
PHASES = ("c1", "loaded")


def install_peer(target: Path | None) -> Path:
    """The peer in a directory of its own, installed once and reused."""
    target = (
        target or Path(tempfile.gettempdir()) / "idempotency-bench-peer" / "drf-idempotency-1.0.0"
    )
    if not (target / "drf_idempotency" / "__init__.py").exists():
        print(f"Installing {PEER} into {target}", flush=True)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
        subprocess.run([*command, "--target", str(target), PEER], check=True)
    return target


class PeerServer(Server):
    """A gunicorn of the bench project on ``peer_settings``, checked to run
    the peer from ``peer_dir`` and not to have loaded our package."""

    def __init__(self, port: int, workers: int, peer_dir: Path) -> None:
        self.peer_dir = peer_dir.resolve()
        super().__init__(port, workers, 1, None, "sync", PEER_SETTINGS, (peer_dir,))

    def _check_library(self) -> str:
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(self.workers * 20):
            conn = http.client.HTTPConnection(HOST, self.port, timeout=10)
            conn.request("GET", "/library/")
            answer = json.loads(conn.getresponse().read())
            conn.close()
            seen[answer["pid"]] = answer
            if len(seen) == self.workers:
                break
        for answer in seen.values():
            if not Path(answer["path"]).is_relative_to(self.peer_dir) or answer["ours_loaded"]:
                self.stop()
                raise RuntimeError(f"the peer server on port {self.port} runs {answer}")
        answer = next(iter(seen.values()))
        return f"drf-idempotency {answer['version']} from {Path(answer['path']).parent}"


def clear_peer_records() -> None:
    """The peer writes to Redis under its own prefix, which ``reset_schema``
    does not empty; old records would turn fresh keys into replays."""
    from django.core.cache import cache

    from benchmarks.benchproject.peer_settings import PEER_REDIS_PREFIX

    client = cache.client.get_client()  # type: ignore[attr-defined]
    for key in client.scan_iter(f"{PEER_REDIS_PREFIX}*", count=1000):
        client.delete(key)


class Peers(Fleet):
    def __init__(self, args: argparse.Namespace, peer_dir: Path) -> None:
        self.args = args
        self.run_id = time.strftime("%H%M%S")
        servers: dict[str, Server] = {}
        try:  # a server that fails to start stops those started before it
            servers[OURS] = Server(args.port, args.workers, 1, worker_class="sync")
            if args.replay_cache > 0:
                os.environ["IDEMPOTENCY_BENCH_REPLAY_CACHE"] = str(args.replay_cache)
                servers[CACHED] = Server(
                    args.port + 3, args.workers, 1, worker_class="sync", settings=CACHED_SETTINGS
                )
            servers[PEER_NAME] = PeerServer(args.port + 1, args.workers, peer_dir)
            if args.baseline:
                servers[BASE] = Server(
                    args.port + 2, args.workers, 1, library=args.baseline, worker_class="sync"
                )
            self.replay_keys = {
                name: seed_replays(server.port, f"{self.run_id}-{name}")
                for name, server in servers.items()
            }
        except BaseException:
            for server in servers.values():
                server.stop()
            raise
        for name, server in servers.items():
            print(f"{name} server (port {server.port}) runs {server.library}")
        print(flush=True)
        super().__init__(servers, args.processes, args.connections)
        self.cells = [(server, scenario) for server in servers for scenario in SCENARIOS]

    def measure(
        self, server: str, scenario: str, phase: str, r: int, seconds: float
    ) -> dict[str, Any]:
        single = phase == "c1"
        cell = Cell(
            SCENARIOS[scenario],
            (server,),
            1 if single else self.clients.per_process,
            time.time() + 0.3,
            seconds,
            json.dumps(BODY).encode(),
            key_prefix=f"{self.run_id}-{server}-{scenario}-{r}-{phase}",
            replay_keys=self.replay_keys[server],
        )
        senders = 1 if single else self.clients.processes
        figures = self.clients.run(cell, senders, [self.servers[server]])
        return {"round": r, "server": server, "scenario": scenario, "phase": phase, **figures}

    def rounds(self) -> list[dict[str, Any]]:
        for server, scenario in self.cells:  # warm-up, not recorded
            self.measure(server, scenario, "loaded", -1, 0.5)
        cells: list[dict[str, Any]] = []
        for r in range(self.args.rounds):
            mine = []
            for server, scenario in rotated(self.cells, r):
                for phase in PHASES:
                    mine.append(self.measure(server, scenario, phase, r, self.args.seconds))
            cells += mine
            print(f"\nround {r + 1}/{self.args.rounds}")
            print(summarize(mine, list(self.servers)), flush=True)
        return cells

    def race(self, server: str) -> dict[str, Any]:
        """Each of ``--race-keys`` keys sent by ``--race-copies`` clients at
        once; the Charge rows labelled with a key count the view's runs."""
        from django.db import connection
        from django.db.models import Count

        from benchmarks.benchproject.models import Charge

        prefix = f"race-{self.run_id}-{server}"
        keys = [f"{prefix}-{i}" for i in range(self.args.race_keys)]
        barrier = threading.Barrier(self.args.race_copies)
        answers: Counter[str] = Counter()
        lock = threading.Lock()

        def sender() -> None:
            conn = http.client.HTTPConnection(HOST, self.servers[server].port, timeout=60)
            for key in keys:
                body = json.dumps({**BODY, "label": key}).encode()
                barrier.wait()
                try:
                    status, replayed, _ = send(conn, "/idem/", body, key)
                    answer = f"{status}{' replayed' if replayed else ''}"
                except (OSError, http.client.HTTPException) as exc:
                    answer = type(exc).__name__
                    conn.close()
                with lock:
                    answers[answer] += 1
            conn.close()

        threads = [threading.Thread(target=sender) for _ in range(self.args.race_copies)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rows = dict(
            Charge.objects.filter(label__startswith=f"{prefix}-")
            .values_list("label")
            .annotate(n=Count("id"))
        )
        connection.close()
        runs = [rows.get(key, 0) for key in keys]
        return {
            "server": server,
            "keys": len(keys),
            "dups": sum(n - 1 for n in runs if n > 1),
            "never ran": runs.count(0),
            "answers": dict(sorted(answers.items())),
        }


def summarize(cells: list[dict[str, Any]], servers: list[str]) -> str:
    """The figures per server and scenario, then per library the ratios and
    the CPU a fresh request adds, each taken within a round; medians over
    the rounds ``cells`` hold (one round: that round's figures)."""
    rounds = sorted({c["round"] for c in cells})
    at = {(c["round"], c["server"], c["scenario"], c["phase"]): c for c in cells}

    def figure(server: str, scenario: str, phase: str, what: str) -> float:
        return median([at[r, server, scenario, phase][what] for r in rounds])

    def per_round(server: str, a: str, b: str, phase: str, what: str, fn: Any) -> float:
        return median(
            [fn(at[r, server, a, phase][what], at[r, server, b, phase][what]) for r in rounds]
        )

    rows = []
    for server in servers:
        for scenario in SCENARIOS:
            bad: Counter[str] = Counter()
            for r in rounds:
                for phase in PHASES:
                    bad.update(at[r, server, scenario, phase]["unexpected"])
            rows.append(
                [
                    server,
                    scenario,
                    *(f"{figure(server, scenario, p, 'rps'):,.0f}" for p in PHASES),
                    *(f"{figure(server, scenario, p, 'p50'):.2f}" for p in PHASES),
                    f"{figure(server, scenario, 'loaded', 'cpu_us'):,.0f}",
                    ", ".join(f"{k}: {v}" for k, v in bad.items()) or "none",
                ]
            )
    headers = ["server", "scenario", "req/s c1", "req/s loaded", "p50 ms c1", "p50 ms loaded"]
    lines = [table([*headers, "worker CPU us/req", "unexpected"], rows), ""]

    rows = [
        [
            server,
            *(f"{per_round(server, 'fresh', 'plain', p, 'rps', truediv):.2f}x" for p in PHASES),
            *(f"{per_round(server, 'replay', 'floor', p, 'rps', truediv):.2f}x" for p in PHASES),
            f"{per_round(server, 'fresh', 'plain', 'loaded', 'cpu_us', sub):+,.0f}",
        ]
        for server in servers
    ]
    headers = ["library", "fresh/plain c1", "fresh/plain loaded", "replay/floor c1"]
    headers += ["replay/floor loaded", "added worker CPU us per fresh request"]
    lines.append(table(headers, rows))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each cell")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn sync workers per server")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--connections", type=int, default=8, help="loaded connections, in all")
    parser.add_argument(
        "--port", type=int, default=8751, help="the peer takes port + 1, base + 2, ours+cache + 3"
    )
    parser.add_argument(
        "--replay-cache",
        type=float,
        default=5,
        metavar="SECONDS",
        help="also ours with REPLAY_CACHE set to this (0: not)",
    )
    parser.add_argument("--baseline", type=Path, metavar="DIR", help="a checkout of ours to add")
    parser.add_argument("--peer-dir", type=Path, help=f"where {PEER} is (or goes) installed")
    parser.add_argument("--race-keys", type=int, default=60)
    parser.add_argument("--race-copies", type=int, default=4, help="clients sending each key")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.baseline and not (args.baseline / "idempotency_app" / "__init__.py").exists():
        parser.error(f"--baseline {args.baseline}: no idempotency_app package there")
    use_database("postgres")
    peer_dir = install_peer(args.peer_dir)
    notes = prepare()
    clear_peer_records()
    print(f"checkout measured: {ROOT} at {git_describe(ROOT)}")
    print(
        f"{args.rounds} rounds x (c1 + loaded), {args.seconds:g} s per cell; gunicorn "
        f"{args.workers} sync workers per server; {args.processes} client processes, "
        f"{args.connections} connections when loaded\n"
    )
    bench = Peers(args, peer_dir)
    try:
        cells = bench.rounds()
        races = [bench.race(server) for server in bench.servers]
    finally:
        bench.close()
    print(f"\nMedians over {args.rounds} rounds")
    print(summarize(cells, list(bench.servers)))
    rows = [
        [
            r["server"],
            f"{r['dups']}/{r['keys']}" + ("" if r["dups"] == 0 else " (MUST BE 0)"),
            str(r["never ran"]),
            ", ".join(f"{k}: {v}" for k, v in r["answers"].items()),
        ]
        for r in races
    ]
    print(f"\nRace: each key sent by {args.race_copies} clients at once")
    print(table(["library", "dups/keys", "keys never run", "answers"], rows))
    print(f"\nload average before: {notes['load']}; after: {load_average()}")


if __name__ == "__main__":
    main()
