"""Figures behind the async design (docs/async.md): what running the unit
of work as one thread-sensitive call, with the view's coroutine driven
inside it, costs next to the same async view without idempotency, and next
to a sync view under the same server.

    .venv/bin/python -m benchmarks.async_design

Needs the shared PostgreSQL (127.0.0.1:5432, user postgres); it migrates
its own database, ``idempotency_async_bench``, and serves tests/urls.py with
uvicorn (one worker) on a free port. Prints medians and p90s in ms.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = "idempotency_async_bench"
ROUNDS = 300
WARMUP = 30


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(len(ordered) * 0.9)]
    return f"p50 {statistics.median(ordered) * 1000:6.2f} ms  p90 {p90 * 1000:6.2f} ms"


def hops() -> None:
    """The bridge alone, in process: what one unit adds besides its queries."""
    from asgiref.sync import ThreadSensitiveContext

    from idempotency_app.lifecycle import aio

    async def noop() -> None:
        return None

    async def measure(label: str, step: Callable[[], Any]) -> None:
        samples = []
        async with ThreadSensitiveContext():
            for _ in range(2000):
                started = time.perf_counter()
                await step()
                samples.append(time.perf_counter() - started)
        print(f"  {label:58s} {_ms(samples)}")

    async def main() -> None:
        await measure("await coroutine (no bridge)", noop)
        await measure("sync_to_async(thread_sensitive) of a no-op", lambda: aio.in_unit_thread(int))
        await measure(
            "the unit's bridge: sync_to_async + async_to_sync(coroutine)",
            lambda: aio.in_unit_thread(aio.blocking(noop)),
        )

    print("Thread hops, in process (2000 each):")
    asyncio.run(main())


def requests(url: str) -> None:
    from tests import servers

    def timed(path: str, key: Callable[[], str | None]) -> list[float]:
        samples = []
        for i in range(WARMUP + ROUNDS):
            started = time.perf_counter()
            response = servers.post(url, path, {"label": "bench", "amount": 1}, key())
            elapsed = time.perf_counter() - started
            assert response.status < 300, (path, response.status, response.body[:200])
            if i >= WARMUP:
                samples.append(elapsed)
        return samples

    fixed = str(uuid.uuid4())
    servers.post(url, "/async/charges/", {"label": "bench", "amount": 1}, fixed)
    cases = [
        ("async view, not idempotent", "/async/plain-charges/", lambda: None),
        ("async view, @idempotent, fresh key", "/async/charges/", lambda: str(uuid.uuid4())),
        ("async view, @idempotent, replay", "/async/charges/", lambda: fixed),
        ("async view, @idempotent, no key", "/async/charges/", lambda: None),
        ("sync view, @idempotent, fresh key", "/charges/", lambda: str(uuid.uuid4())),
    ]
    print(f"\nOne client, sequential, {ROUNDS} requests each (uvicorn, 1 worker, PostgreSQL):")
    for label, path, key in cases:
        print(f"  {label:40s} {_ms(timed(path, key))}")

    print("\nEight clients at once, 400 requests in all, fresh keys:")
    for label, path in (
        ("not idempotent", "/async/plain-charges/"),
        ("@idempotent", "/async/charges/"),
    ):
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            done = list(
                pool.map(
                    lambda _, path=path: (
                        servers.post(url, path, {"label": "b"}, str(uuid.uuid4())).status
                    ),
                    range(400),
                )
            )
        elapsed = time.perf_counter() - started
        assert all(status < 300 for status in done), done
        print(f"  async view, {label:30s} {400 / elapsed:7.1f} requests/s")


def main() -> None:
    sys.path.insert(0, str(ROOT))
    env = {
        "IDEMPOTENCY_TEST_DB": "postgres",
        "IDEMPOTENCY_TEST_DB_NAME": DB_NAME,
        "IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY": '{"TRANSIENT_ERROR_TTL": 0}',
    }
    import psycopg

    with psycopg.connect("host=127.0.0.1 user=postgres dbname=postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,)).fetchone():
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.server_settings")
    from tests import servers
    from tests.asgi_server import uvicorn_server

    servers.prepare_database(env)
    hops()
    with uvicorn_server(env, workers=1) as server:
        requests(server.url)


if __name__ == "__main__":
    main()
