"""django.tasks with the idempotency layer: enqueue_once in process, and two
real db_worker processes racing duplicates on PostgreSQL or MariaDB."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import django
import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import transaction
from django.test.utils import override_settings

from idempotency_app import service
from tests import servers
from tests.asgi_server import database_env, spawn
from tests.concurrency import in_threads
from tests.conftest import needs_server_db
from tests.testapp.models import Charge, LedgerEntry

if not getattr(settings, "TASKS_INSTALLED", False):
    pytest.skip(
        "needs django.tasks (Django 6.0+, or django-tasks on 5.2) and django-tasks-db: "
        "pip install -e '.[test,tasks]'",
        allow_module_level=True,
    )

from django_tasks_db.models import DBTaskResult

from idempotency_app.service.enqueue import _identity_args, aenqueue_once, enqueue_once
from tests.testapp.tasks import apply_event, plain

pytestmark = pytest.mark.django_db(transaction=True)

IMMEDIATE = {
    "default": {
        "BACKEND": ("django.tasks" if django.VERSION >= (6, 0) else "django_tasks")
        + ".backends.immediate.ImmediateBackend"
    }
}


def test_a_key_is_enqueued_once_and_duplicates_get_its_result() -> None:
    first = enqueue_once(plain, "a", key="job-1")
    again = enqueue_once(plain, "a", key="job-1")
    assert first is not None and again is not None
    assert again.id == first.id
    assert DBTaskResult.objects.count() == 1


def test_the_same_key_with_other_arguments_is_refused() -> None:
    enqueue_once(plain, "a", key="job-2")
    with pytest.raises(service.KeyReused):
        enqueue_once(plain, "b", key="job-2")
    assert DBTaskResult.objects.count() == 1


def test_keys_are_per_scope_and_another_task_is_another_operation() -> None:
    enqueue_once(plain, "a", key="job-3")
    enqueue_once(plain, "a", key="job-3", scope="tenant:2")
    with pytest.raises(service.KeyReused):
        enqueue_once(apply_event, {"id": "x"}, key="job-3")
    assert DBTaskResult.objects.count() == 2


def test_an_enqueue_that_rolls_back_leaves_no_task_and_no_key() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        enqueue_once(plain, "a", key="job-4")
        raise RuntimeError("the caller's transaction fails after enqueueing")
    assert DBTaskResult.objects.count() == 0
    assert service.lookup("tasks", "job-4") is None
    assert enqueue_once(plain, "a", key="job-4") is not None
    assert DBTaskResult.objects.count() == 1


def test_async_enqueue_once() -> None:
    async def twice() -> tuple[Any, Any]:
        first = await aenqueue_once(plain, "a", key="job-5")
        return first, await aenqueue_once(plain, "a", key="job-5")

    first, again = async_to_sync(twice)()
    assert first.id == again.id
    assert DBTaskResult.objects.count() == 1


def test_on_a_backend_that_cannot_fetch_results_duplicates_get_none() -> None:
    with override_settings(TASKS=IMMEDIATE):
        first = enqueue_once(plain, "now", key="job-6")
        again = enqueue_once(plain, "now", key="job-6")
    assert first is not None and first.return_value == "now"
    assert again is None
    assert Charge.objects.count() == 1, "the immediate backend ran the task once"


def test_a_duplicate_whose_first_result_was_pruned_gets_none() -> None:
    first = enqueue_once(plain, "a", key="job-7")
    assert first is not None
    DBTaskResult.objects.all().delete()  # as prune_db_task_results does
    assert enqueue_once(plain, "a", key="job-7") is None
    assert async_to_sync(aenqueue_once)(plain, "a", key="job-7") is None
    assert DBTaskResult.objects.count() == 0, "the key still keeps it to one enqueue"


@pytest.mark.parametrize("lease", [2, 5])
def test_the_default_wait_ends_before_a_short_lease(lease: float) -> None:
    """A producer finding the key held waits 5 s by default, but never as
    long as LEASE (half of it here), and then raises KeyInProgress."""
    identity = _identity_args(plain, "job-8", "tasks", ("a",), {})
    with override_settings(IDEMPOTENCY={"LEASE": lease}):
        held = service.claim(*identity)
        assert isinstance(held, service.Held)
        started = time.monotonic()
        with pytest.raises(service.KeyInProgress):
            enqueue_once(plain, "a", key="job-8")
        waited = time.monotonic() - started
        assert service.release(held)
        assert enqueue_once(plain, "a", key="job-8") is not None
    print(f"\nENQUEUE_ONCE default wait with LEASE {lease} s: gave up after {waited:.2f} s")
    assert lease / 2 - 0.2 <= waited < lease / 2 + 0.5
    assert DBTaskResult.objects.count() == 1


def test_a_task_called_twice_runs_once() -> None:
    with override_settings(TASKS=IMMEDIATE):
        first = apply_event.enqueue({"id": "evt-1"})
        again = apply_event.enqueue({"id": "evt-1"})
    assert first.return_value == again.return_value
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1


# -- real workers ------------------------------------------------------------


@contextlib.contextmanager
def db_workers(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` db_worker processes on this run's database; stopped on the
    way out, also when the test fails."""
    env = servers.python_env(database_env())
    processes: list[subprocess.Popen[bytes]] = []
    with servers._workdir("db-worker") as workdir:
        try:
            for index in range(count):
                command = [
                    sys.executable, "-m", "django", "db_worker", "--queue-name", "default",
                    "--interval", "0.05", "--no-startup-delay", "--worker-id", f"w{index}",
                ]  # fmt: skip
                processes.append(spawn(command, env, workdir / f"worker{index}.log"))
            yield processes
        finally:
            for process in processes:
                servers._stop_process(process, grace=10)


def wait_until_finished(ids: list[str], timeout: float = 60) -> list[Any]:
    deadline = time.monotonic() + timeout
    while True:
        results = [apply_event.get_result(i) for i in ids]
        if all(r.is_finished for r in results):
            return results
        assert time.monotonic() < deadline, [r.status for r in results]
        time.sleep(0.1)


@needs_server_db
@pytest.mark.slow
def test_two_workers_run_concurrent_duplicates_once() -> None:
    event = {"id": f"evt-{uuid.uuid4()}", "amount": 5, "sleep": 0.5}
    with db_workers(2):
        started = time.monotonic()
        enqueued = in_threads(8, lambda: apply_event.enqueue(event))
        results = wait_until_finished([str(r.id) for r in enqueued])
        elapsed = time.monotonic() - started
    statuses = Counter(str(r.status).rsplit(".", 1)[-1] for r in results)
    workers = Counter(r.worker_ids[-1] for r in results)
    print(
        f"\nDJANGO.TASKS duplicates: 8 enqueued, 2 workers {dict(workers)}, outcomes "
        f"{dict(statuses)}, executions {Charge.objects.count()}, {elapsed:.2f} s"
    )
    assert statuses == Counter({"SUCCESSFUL": 8})
    assert len({str(r.return_value) for r in results}) == 1, "every copy got the stored result"
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
    assert len(workers) == 2, "both workers took copies"


@needs_server_db
@pytest.mark.slow
def test_concurrent_enqueue_once_enqueues_and_runs_once() -> None:
    event = {"id": f"evt-{uuid.uuid4()}", "sleep": 0.2}
    with db_workers(2):
        started = time.monotonic()
        enqueued = in_threads(8, lambda: enqueue_once(apply_event, event, key=event["id"]))
        ids = {str(r.id) for r in enqueued}
        results = wait_until_finished(sorted(ids))
        elapsed = time.monotonic() - started
    print(
        f"\nDJANGO.TASKS enqueue_once: 8 producers, {len(ids)} enqueued, outcome "
        f"{results[0].status}, executions {Charge.objects.count()}, {elapsed:.2f} s"
    )
    assert len(ids) == 1, enqueued
    assert DBTaskResult.objects.count() == 1
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
