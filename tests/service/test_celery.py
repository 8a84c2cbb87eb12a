"""The Celery recipe of docs/tasks.md (tests/celery_app.py) against real
workers, on RabbitMQ and on Redis: duplicates published at once, a prefork
child SIGKILLed mid-task, and a whole worker SIGKILLed mid-task. Each broker
is skipped when it does not answer."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from idempotency_app.models import IdempotencyRecord
from tests import servers
from tests.asgi_server import database_env, spawn
from tests.concurrency import in_threads
from tests.conftest import needs_server_db
from tests.testapp.models import Charge, LedgerEntry

pytest.importorskip("celery", reason="needs Celery: pip install -e '.[test]'")

AMQP = os.environ.get("IDEMPOTENCY_TEST_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
# A database of its own: other test runs share the server.
REDIS = os.environ.get("IDEMPOTENCY_TEST_CELERY_REDIS_BROKER", "redis://127.0.0.1:6379/7")
QUEUE = f"idempotency-tests-{uuid.uuid4().hex[:12]}"


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    default = 6379 if parts.scheme.startswith("redis") else 5672
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default), 1):
            return True
    except OSError:
        return False


pytestmark = [needs_server_db, pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(AMQP, id="rabbitmq", marks=pytest.mark.skipif(
            not _answers(AMQP),
            reason=f"needs a RabbitMQ broker at {AMQP} (rabbitmq-server -detached), "
            "or IDEMPOTENCY_TEST_CELERY_BROKER",
        )),
        pytest.param(REDIS, id="redis", marks=pytest.mark.skipif(
            not _answers(REDIS),
            reason=f"needs Redis at {REDIS}, or IDEMPOTENCY_TEST_CELERY_REDIS_BROKER",
        )),
    ],
)  # fmt: skip
def broker(request: pytest.FixtureRequest) -> Iterator[str]:
    """The broker's URL; on the way out, this run's keys leave Redis."""
    url: str = request.param
    yield url
    from tests.celery_app import is_redis

    if is_redis(url):
        import redis

        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{QUEUE}:*"):
            client.delete(key)
        client.close()


@pytest.fixture(scope="module")
def apply_event(broker: str) -> Iterator[Any]:
    """The recipe's task, published from this process through ``broker``."""
    from tests.celery_app import TASK_NAME, make_app

    app = make_app(broker, QUEUE)
    yield app.tasks[TASK_NAME]
    app.close()


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def celery_worker(broker: str, name: str, concurrency: int = 2) -> Iterator[Worker]:
    """A worker consuming this run's queue (prefork, or solo for one
    process); stopped on the way out (SIGTERM, then SIGKILL to its session),
    also when the test fails."""
    env = servers.python_env(
        {**database_env(), "IDEMPOTENCY_TEST_CELERY_QUEUE": QUEUE,
         "IDEMPOTENCY_TEST_CELERY_BROKER": broker}
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
            yield Worker(process, log)
        finally:
            servers._stop_process(process, grace=15)


def label(broker: str) -> str:
    return "Redis" if broker.startswith("redis") else "RabbitMQ"


def retries(log: str) -> int:
    """Retries of a copy that found the key in progress (Celery logs each)."""
    return log.count("] retry: ")


def event(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"id": f"evt-{uuid.uuid4()}", "attempts": str(tmp_path / "attempts"), **extra}


def attempts(payload: dict[str, Any]) -> list[str]:
    """The pid of each attempt that got to run the work."""
    path = Path(payload["attempts"])
    return path.read_text().split() if path.exists() else []


def first_attempt(payload: dict[str, Any], timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not attempts(payload):
        assert time.monotonic() < deadline, "no worker started the task"
        time.sleep(0.05)
    assert IdempotencyRecord.objects.get(key=payload["id"]).status == "in_progress"
    return int(attempts(payload)[0])


def assert_ran_once(payload: dict[str, Any], results: list[Any]) -> None:
    """The work committed once, every copy got the one stored result, and
    the record ended completed."""
    assert len({str(r) for r in results}) == 1, results
    assert results[0]["event"] == payload["id"]
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
    assert results[0]["charge"] == Charge.objects.get().pk
    assert IdempotencyRecord.objects.get(key=payload["id"]).status == "completed"


def test_duplicates_published_at_once_run_once(
    broker: str, apply_event: Any, tmp_path: Path
) -> None:
    payload = event(tmp_path, hang=1.0, amount=3)
    with celery_worker(broker, "dup", concurrency=2) as worker:
        started = time.monotonic()
        sent = in_threads(8, lambda: apply_event.delay(payload))
        results = [r.get(timeout=90) for r in sent]
        elapsed = time.monotonic() - started
        retried = retries(worker.text())
    print(
        f"\nCELERY {label(broker)} duplicates: 8 published, 1 worker x 2 "
        f"processes, {len(attempts(payload))} attempt(s) ran the work, {retried} retries, "
        f"results {dict(Counter(str(r) for r in results))}, executions "
        f"{Charge.objects.count()}, {elapsed:.2f} s"
    )
    assert len(attempts(payload)) == 1
    assert_ran_once(payload, results)


def test_a_prefork_child_killed_mid_task_is_requeued_and_runs_once(
    broker: str, apply_event: Any, tmp_path: Path
) -> None:
    """reject_on_worker_lost: the worker gives the lost child's message back
    to the broker at once; without it the message is acknowledged as failed
    (WorkerLostError) and the task is lost with its claim in progress."""
    from tests.celery_app import LEASE

    payload = event(tmp_path, hang=120, sleep=0.2)
    started = time.monotonic()
    with celery_worker(broker, "child", concurrency=2) as worker:
        first = apply_event.delay(payload)
        child = first_attempt(payload)
        assert child != worker.process.pid, "the task runs in a child of the worker"
        os.kill(child, signal.SIGKILL)  # mid-task: its transaction never commits
        killed_at = time.monotonic()
        result = first.get(timeout=60)
        recovered = time.monotonic() - killed_at
        copy = apply_event.delay(payload).get(timeout=60)
        assert worker.process.poll() is None, "the worker itself lived on"
        log = worker.text()
    print(
        f"\nCELERY {label(broker)} killed child: 1 published + 1 copy, "
        f"{len(attempts(payload))} attempts ran the work (1 killed), "
        f"{retries(log)} retries while the lease ran, result {result}, "
        f"copy {copy}, executions {Charge.objects.count()}, recovered {recovered:.2f} s "
        f"after the kill (lease {LEASE} s), {time.monotonic() - started:.2f} s in all"
    )
    assert "WorkerLostError" in log, "the worker saw its child die"
    assert len(attempts(payload)) == 2, "the killed attempt and the one after the lease"
    assert attempts(payload)[0] == str(child)
    assert_ran_once(payload, [result, copy])


def test_a_worker_killed_mid_task_is_redelivered_and_runs_once(
    broker: str, apply_event: Any, tmp_path: Path
) -> None:
    """The whole worker dies: RabbitMQ redelivers its unacknowledged message
    when its connection drops, Redis once visibility_timeout has passed."""
    from tests.celery_app import LEASE, RECIPE_SETTINGS, is_redis

    payload = event(tmp_path, hang=120, sleep=0.2)
    started = time.monotonic()
    with celery_worker(broker, "doomed", concurrency=1) as doomed:
        first = apply_event.delay(payload)
        first_attempt(payload)
        os.killpg(doomed.process.pid, signal.SIGKILL)  # mid-task
        doomed.process.wait(timeout=10)
        killed_at = time.monotonic()
    assert Charge.objects.count() == 0, "the killed attempt's writes are gone"
    with celery_worker(broker, "survivor", concurrency=2):
        # Redis: visibility_timeout, then kombu's sweep (1 s in the test
        # app; about 100 s in kombu versions that cannot set it).
        result = first.get(timeout=150)
        recovered = time.monotonic() - killed_at
        copy = apply_event.delay(payload).get(timeout=60)
    redelivery = (
        f"visibility_timeout {RECIPE_SETTINGS['broker_transport_options']['visibility_timeout']} s"
        if is_redis(broker)
        else "redelivered on disconnect"
    )
    print(
        f"\nCELERY {label(broker)} killed worker: 1 published + 1 copy, "
        f"{redelivery}, {len(attempts(payload))} attempts ran the work (1 killed), "
        f"result {result}, copy {copy}, executions {Charge.objects.count()}, recovered "
        f"{recovered:.2f} s after the kill (lease {LEASE} s), "
        f"{time.monotonic() - started:.2f} s in all"
    )
    assert len(attempts(payload)) == 2, "the killed attempt and the one after the lease"
    assert_ran_once(payload, [result, copy])
