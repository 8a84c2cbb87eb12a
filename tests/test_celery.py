"""Celery with @idempotent_task (the docs/service.md pattern) against real
workers on the RabbitMQ broker: duplicates published at once, and a worker
killed mid-task with acks_late. Skipped when no broker answers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idempotency_app.models import IdempotencyRecord
from tests import servers
from tests.asgi_server import database_env, spawn
from tests.concurrency import in_threads
from tests.conftest import needs_server_db
from tests.testapp.models import Charge, LedgerEntry

pytest.importorskip("celery", reason="needs Celery: pip install -e '.[test]'")

BROKER = os.environ.get("IDEMPOTENCY_TEST_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
QUEUE = f"idempotency-tests-{uuid.uuid4().hex[:12]}"
os.environ["IDEMPOTENCY_TEST_CELERY_QUEUE"] = QUEUE


def _broker_answers() -> bool:
    host, _, port = BROKER.split("@")[-1].split("/")[0].partition(":")
    try:
        with socket.create_connection((host, int(port or 5672)), timeout=1):
            return True
    except OSError:
        return False


pytestmark = [
    needs_server_db,
    pytest.mark.skipif(
        not _broker_answers(),
        reason=f"needs a RabbitMQ broker at {BROKER} (rabbitmq-server -detached), "
        "or IDEMPOTENCY_TEST_CELERY_BROKER",
    ),
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
]


@contextlib.contextmanager
def celery_worker(name: str, concurrency: int = 2) -> Iterator[subprocess.Popen[bytes]]:
    """A worker consuming this run's queue; stopped on the way out (SIGTERM,
    then SIGKILL to its session), also when the test fails."""
    env = servers.python_env(
        {**database_env(), "IDEMPOTENCY_TEST_CELERY_QUEUE": QUEUE,
         "IDEMPOTENCY_TEST_CELERY_BROKER": BROKER}
    )  # fmt: skip
    with servers._workdir(f"celery-{name}") as workdir:
        log = workdir / "worker.log"
        command = [
            sys.executable, "-m", "celery", "-A", "tests.celery_app", "worker",
            "--loglevel", "INFO", "-n", f"{name}-{QUEUE}@%h", "-Q", QUEUE,
            "--concurrency", str(concurrency), "--pool", "prefork" if concurrency > 1 else "solo",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        process = spawn(command, env, log)
        try:
            servers._wait_until(lambda: b"ready." in log.read_bytes(), "celery", log, process)
            yield process
        finally:
            servers._stop_process(process, grace=15)


def event(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"id": f"evt-{uuid.uuid4()}", "attempts": str(tmp_path / "attempts"), **extra}


def attempts(payload: dict[str, Any]) -> list[str]:
    path = Path(payload["attempts"])
    return path.read_text().split() if path.exists() else []


def test_duplicates_published_at_once_run_once(tmp_path: Path) -> None:
    from tests.celery_app import apply_event

    payload = event(tmp_path, hang=1.0, amount=3)
    with celery_worker("dup", concurrency=2):
        started = time.monotonic()
        sent = in_threads(8, lambda: apply_event.delay(payload))
        results = [r.get(timeout=90) for r in sent]
        elapsed = time.monotonic() - started
    print(
        f"\nCELERY duplicates: 8 published, 1 worker x 2 processes, "
        f"{len(attempts(payload))} attempt(s) ran the work, results "
        f"{dict(Counter(str(r) for r in results))}, executions {Charge.objects.count()}, "
        f"{elapsed:.2f} s"
    )
    assert len({str(r) for r in results}) == 1, "every copy got the one stored result"
    assert results[0]["event"] == payload["id"]
    assert len(attempts(payload)) == 1
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1


def test_a_worker_killed_mid_task_is_redelivered_and_runs_once(tmp_path: Path) -> None:
    from tests.celery_app import LEASE, apply_event

    payload = event(tmp_path, hang=120, sleep=0.2)
    started = time.monotonic()
    with celery_worker("doomed", concurrency=1) as doomed:
        first = apply_event.delay(payload)
        deadline = time.monotonic() + 60
        while not attempts(payload):
            assert time.monotonic() < deadline, "the first worker never started the task"
            time.sleep(0.05)
        assert IdempotencyRecord.objects.get(key=payload["id"]).status == "in_progress"
        os.killpg(doomed.pid, signal.SIGKILL)  # mid-task: its transaction never commits
        doomed.wait(timeout=10)
        killed_at = time.monotonic()
    assert Charge.objects.count() == 0, "the killed attempt's writes are gone"
    with celery_worker("survivor", concurrency=2):
        result = first.get(timeout=90)
        recovered = time.monotonic() - killed_at
        copy = apply_event.delay(payload).get(timeout=60)
    print(
        f"\nCELERY killed worker: 1 published + 1 copy, acks_late redelivery, "
        f"{len(attempts(payload))} attempts ran the work (1 killed), result {result}, "
        f"copy {copy}, executions {Charge.objects.count()}, recovered {recovered:.2f} s "
        f"after the kill (lease {LEASE} s), {time.monotonic() - started:.2f} s in all"
    )
    assert result == copy and result["event"] == payload["id"]
    assert len(attempts(payload)) == 2, "the killed attempt and the one after the lease"
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
    assert IdempotencyRecord.objects.get(key=payload["id"]).status == "completed"
