"""Processes for the async and task-runner tests: uvicorn serving tests.urls
(tests/asgi.py) on a free port, and ``spawn`` for any worker; the
environment, port choice and stopping are tests/servers.py's."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from tests import servers


def database_env() -> dict[str, str]:
    """The environment that points a server at this test run's database and
    cache (the test database pytest-django created, not its base name)."""
    db = settings.DATABASES["default"]
    env = {
        "IDEMPOTENCY_TEST_DB": settings.DB,
        "IDEMPOTENCY_TEST_DB_HOST": str(db.get("HOST") or "127.0.0.1"),
        "IDEMPOTENCY_TEST_DB_PORT": str(db.get("PORT") or ""),
        "IDEMPOTENCY_TEST_DB_USER": str(db.get("USER") or ""),
        "IDEMPOTENCY_TEST_DB_PASSWORD": str(db.get("PASSWORD") or ""),
        "IDEMPOTENCY_TEST_DB_NAME": str(connection.settings_dict["NAME"]),
    }
    if settings.REDIS_URL:
        env["IDEMPOTENCY_TEST_REDIS_URL"] = settings.REDIS_URL
    return {name: value for name, value in env.items() if value}


def spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``command`` in a session of its own (so a stop reaches its children),
    from the repository's root, its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            command, cwd=servers.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


@contextlib.contextmanager
def uvicorn_server(
    env: Mapping[str, str], workers: int = 2, extra_args: tuple[str, ...] = ()
) -> Iterator[servers.AppServer]:
    """``uvicorn tests.asgi:application`` with ``workers`` processes; stopped
    (SIGTERM, then SIGKILL to its session) on the way out, also on failure."""
    pytest.importorskip("uvicorn", reason="needs uvicorn: pip install -e '.[test]'")
    port = servers.free_port()
    with servers._workdir("uvicorn") as workdir:
        full_env = servers.python_env(env)
        log = workdir / "uvicorn.log"
        command = [
            sys.executable, "-m", "uvicorn", "tests.asgi:application",
            "--host", servers.HOST, "--port", str(port), "--workers", str(workers),
            "--log-level", "warning", "--no-access-log", *extra_args,
        ]  # fmt: skip
        process = spawn(command, full_env, log)
        server = servers.AppServer(process, port, log, full_env)
        try:
            # One worker is the process itself; more are its children.
            children = workers if workers > 1 else 0
            servers._wait_until(
                lambda: servers._answers_http(port) and len(server.worker_pids()) >= children,
                "uvicorn", log, process,
            )  # fmt: skip
            yield server
        finally:
            server.stop()


def post_all(url: str, path: str, body: Any, key: str | None, count: int) -> list[Any]:
    """``count`` POSTs released together from threads; each a Response, or
    the OSError it raised."""
    from tests.concurrency import in_threads

    return in_threads(count, lambda: servers.post(url, path, body, key, timeout=60))
