"""gunicorn servers and HTTP client processes, shared by run.py, scaleout.py and peers.py.

Servers run the bench project under gunicorn (gthread workers unless told
otherwise) on loopback. Each can import ``idempotency_app`` from another
checkout (``library``), so one run can measure two versions of the library
side by side, and each says at start-up, through ``/library/``, where its
package really comes from. ``peers.py`` also serves other settings (a peer
library's) with extra directories on the path.

Clients are separate processes, each holding keep-alive ``http.client``
connections to every server, opened once and spread evenly over the
workers (the floor view names its worker), and kept for the whole run, so
that every scenario is served by the same connections. A cell is one
scenario for a fixed time from some of those connections, driven by
threads; every response's status and ``Idempotent-Replayed`` header is
checked, and anything unexpected is counted.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ROOT,
    SETTINGS,
    git_describe,
    imports_from,
    library_shim,
    machine,
    percentile,
    print_machine,
    reset_schema,
    setup_django,
)

HOST = "127.0.0.1"
TOKEN = "bench-token-1"
BODY = {"label": "bench", "amount": 100}
REPLAY_KEYS = 64


@dataclass(frozen=True)
class Scenario:
    path: str
    status: int
    replayed: bool = False


FLOOR = Scenario("/floor/", 200)
PLAIN = Scenario("/plain/", 201)
FRESH = Scenario("/idem/", 201)
REPLAY = Scenario("/idem/", 201, replayed=True)
CONFLICT = Scenario("/idem/", 409)


# ---------------------------------------------------------------- client side


@dataclass
class Cell:
    """One scenario for a fixed time, from one client process, on the first
    ``per_server`` connections it holds to each of ``servers``."""

    scenario: Scenario
    servers: tuple[str, ...]
    per_server: int
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


def headers(key: str | None) -> dict[str, str]:
    out = {"Authorization": f"Token {TOKEN}", "Content-Type": "application/json"}
    if key is not None:
        out["Idempotency-Key"] = key
    return out


def send(
    conn: http.client.HTTPConnection, path: str, body: bytes, key: str | None
) -> tuple[int, bool, bytes]:
    """One POST; its status, whether it was a replay, and its body."""
    conn.request("POST", path, body, headers(key))
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
        status, _, content = send(conn, "/floor/", b"{}", None)
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
    if cell.scenario.path != "/idem/":
        return None
    if cell.conflict_key:
        return cell.conflict_key
    if cell.scenario.replayed:
        return cell.replay_keys[(index * 7 + n) % len(cell.replay_keys)]
    return f"{cell.key_prefix}-{index}-{n}"


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
            status, replayed, _ = send(conn, cell.scenario.path, cell.body, key)
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
        active = [conn for name in cell.servers for conn in conns[name][: cell.per_server]]
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


class Clients:
    """``processes`` client processes, each holding ``per_process``
    connections to each server, for the whole run."""

    def __init__(self, servers: dict[str, Server], processes: int, per_process: int) -> None:
        ctx = mp.get_context("spawn")
        self.processes = processes
        self.per_process = per_process
        self.commands = [ctx.Queue() for _ in range(processes)]
        self.results = [ctx.Queue() for _ in range(processes)]
        ports = {name: server.port for name, server in servers.items()}
        workers = max(server.workers for server in servers.values())
        self.children = [
            ctx.Process(
                target=client_process,
                args=(ports, per_process, workers, self.commands[i], self.results[i]),
                daemon=True,
            )
            for i in range(processes)
        ]
        for child in self.children:
            child.start()
        for queue in self.results:
            queue.get(timeout=120)

    def run(self, cell: Cell, senders: int, workers: list[Server]) -> dict[str, Any]:
        """The cell from the first ``senders`` processes (each with its own
        key prefix); its figures, with the CPU the ``workers`` used."""
        cpu_before = sum(server.cpu_seconds() for server in workers)
        for i in range(senders):
            self.commands[i].put(replace(cell, key_prefix=f"{cell.key_prefix}-{i}"))
        parts: list[CellResult] = [
            self.results[i].get(timeout=cell.seconds + 120) for i in range(senders)
        ]
        cpu_used = sum(server.cpu_seconds() for server in workers) - cpu_before
        latencies = [x for p in parts for x in p.latencies_ms]
        requests = sum(p.requests for p in parts)
        unexpected: Counter[str] = Counter()
        for p in parts:
            unexpected.update(p.unexpected)
        return {
            "requests": requests,
            "rps": requests / max(p.elapsed for p in parts),
            "p50": percentile(latencies, 0.50),
            "p99": percentile(latencies, 0.99),
            "cpu_us": cpu_used / max(1, requests) * 1e6,
            "unexpected": dict(unexpected),
        }

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for child in self.children:
            child.join(timeout=10)


class Fleet:
    """Servers and the client processes holding connections to them, for a
    whole run; ``connections`` in all, shared out over the processes."""

    def __init__(self, servers: dict[str, Server], processes: int, connections: int) -> None:
        self.servers = servers
        self.clients = Clients(servers, processes, max(1, connections // processes))

    def close(self) -> None:
        self.clients.close()
        for server in self.servers.values():
            server.stop()


def prepare() -> dict[str, str]:
    """Before a load run: the bench extra, Django, an empty schema, and the
    machine notes (printed, and returned for the record)."""
    from django.db import connection

    ensure_installed()
    setup_django()
    reset_schema()
    notes = machine()
    connection.close()  # the servers and clients have their own
    print_machine(notes)
    return notes


def rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` in the order of round ``r``: each round starts one later, so
    no item always runs first (after a pause) or last (on a warm machine)."""
    return items[r % len(items) :] + items[: r % len(items)]


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
    """One gunicorn serving the bench project, stopped by ``stop``.

    ``library``: a checkout whose ``idempotency_app`` this server imports
    instead of this one's, through a ``library_shim`` first on gunicorn's
    path (``--pythonpath``). Every worker's own ``/library/`` answer is
    checked against the checkout it should run. ``settings`` and
    ``pythonpath`` serve another project's configuration (``peers.py``).
    """

    def __init__(
        self,
        port: int,
        workers: int,
        threads: int,
        library: Path | None = None,
        worker_class: str = "gthread",
        settings: str = SETTINGS,
        pythonpath: tuple[Path, ...] = (),
    ) -> None:
        self.port = port
        self.workers = workers
        self.checkout = (library or ROOT).resolve()
        self.log = Path(tempfile.gettempdir()) / f"idempotency-bench-{port}.log"
        command = [
            sys.executable, "-m", "gunicorn", "benchmarks.benchproject.wsgi:application",
            "--bind", f"{HOST}:{port}",
            "--workers", str(workers),
            "--worker-class", worker_class,
            "--keep-alive", "600",
            "--log-level", "warning",
        ]  # fmt: skip
        if worker_class == "gthread":  # gunicorn turns sync workers with threads into gthread
            command += ["--threads", str(threads)]
        self.shim = None if library is None else library_shim(library)
        paths = [str(p) for p in pythonpath] + ([self.shim.name] if self.shim else [])
        if paths:
            command += ["--pythonpath", ",".join(paths)]
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": settings}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_ready()
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        self.pids = [int(p) for p in children.read_text().split()] if children.exists() else []
        if not self.pids:  # what answered is another server, left on the port
            self.stop()
            raise RuntimeError(f"port {port} is taken:\n{self.log.read_text()[-2000:]}")
        self.library = self._check_library()

    def _wait_ready(self) -> None:
        for _ in range(300):
            if self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited:\n{self.log.read_text()[-2000:]}")
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
                if send(conn, "/floor/", b"{}", None)[0] == 200:
                    conn.close()
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gunicorn did not answer:\n{self.log.read_text()[-2000:]}")

    def _check_library(self) -> str:
        """Ask every worker where its ``idempotency_app`` comes from; refuse
        to measure a server that runs another checkout than it should."""
        seen: dict[int, str] = {}
        for _ in range(self.workers * 20):
            conn = http.client.HTTPConnection(HOST, self.port, timeout=10)
            conn.request("GET", "/library/")
            answer = json.loads(conn.getresponse().read())
            conn.close()
            seen[answer["pid"]] = answer["path"]
            if len(seen) == self.workers:
                break
        for path in seen.values():
            if not imports_from(path, self.checkout):
                self.stop()
                raise RuntimeError(
                    f"the server on port {self.port} imports {path}, not {self.checkout}'s"
                )
        return f"{self.checkout / 'idempotency_app'} at {git_describe(self.checkout)}"

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
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        if self.shim is not None:
            self.shim.cleanup()


def seed_replays(port: int, prefix: str) -> list[str]:
    """Keys completed beforehand through the server on ``port``, so that a
    replay scenario reads records written by the library it measures."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    body = json.dumps(BODY).encode()
    keys = [f"{prefix}-replay-{i}" for i in range(REPLAY_KEYS)]
    for key in keys:
        status, _, content = send(conn, "/idem/", body, key)
        if status != 201:
            raise RuntimeError(f"seeding replays on port {port}: {status} {content[:200]!r}")
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
        self.status = send(conn, "/idem/", self.body, self.key)[0]
        conn.close()

    def __enter__(self) -> Holder:
        self.thread.start()
        time.sleep(0.2)
        conn = http.client.HTTPConnection(HOST, self.port, timeout=120)
        for _ in range(100):
            if send(conn, "/idem/", self.body, self.key)[0] == 409:
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
