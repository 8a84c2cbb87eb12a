"""Enqueue a django.tasks task at most once per key.

Imports Django's task framework: ``django.tasks`` (Django 6.0+), or the
``django-tasks`` backport on Django 5.2 (``pip install
"idempotency-app[tasks]"``). Import this module only where one is installed.

``enqueue_once(task, key=...)`` is the producer's half: the enqueue runs
under a claim, inside the transaction that stores the enqueued result's id.
On a database-backed backend writing to ``DATABASE_ALIAS``
(``django_tasks_db.DatabaseBackend``) the task row and the key commit
together, so a key is enqueued exactly once however many producers race.
On any other backend the enqueue is an effect outside the database: a
failure between it and the commit can enqueue the task again on a retry, so
put ``@idempotent_task`` on the task function too (the consumer's half),
which makes every copy run once anyway.
"""

from __future__ import annotations

from typing import Any

from idempotency_app.conf import conf
from idempotency_app.service.aio import aonce
from idempotency_app.service.blocks import Run, once

try:
    from django.tasks import Task, TaskResult
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:  # Django < 6.0: the backport
    from django_tasks import TaskResult  # type: ignore[assignment,no-redef,import-not-found,unused-ignore]
    from django_tasks.base import Task  # type: ignore[assignment,no-redef,import-not-found,unused-ignore]
    from django_tasks.exceptions import TaskResultDoesNotExist  # type: ignore[assignment,no-redef,import-not-found,unused-ignore]

__all__ = ["aenqueue_once", "enqueue_once"]

DEFAULT_SCOPE = "tasks"
# A producer that finds another one enqueueing the same key waits up to this
# long for it (an enqueue is one INSERT) before raising KeyInProgress.
DEFAULT_WAIT = 5.0


def _wait(wait: float | None) -> float:
    """``wait``, or by default ``DEFAULT_WAIT`` but at most half of LEASE: a
    waiting duplicate must give up before the lease ends, or it could take
    over a live claim (so a wait as long as LEASE is refused)."""
    return min(DEFAULT_WAIT, conf.LEASE / 2) if wait is None else wait


def _operation(task: Task[Any, Any]) -> str:
    return f"enqueue {task.module_path}"[-255:]


def _identity_args(
    task: Task[Any, Any], key: str | int, scope: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, str | int, str, Any]:
    """The same key enqueued with other arguments is another request
    (``KeyReused``), never silently the first one's result."""
    return scope, key, _operation(task), {"args": list(args), "kwargs": kwargs}


def _stored(result: TaskResult[Any, Any]) -> dict[str, str]:
    return {"id": str(result.id), "backend": str(result.backend)}


def _fetchable(task: Task[Any, Any], run: Run) -> Task[Any, Any] | None:
    """The task bound to the backend that enqueued the first copy, if that
    backend can fetch results."""
    bound = task.using(backend=run.result["backend"])
    return bound if bound.get_backend().supports_get_result else None


def _replayed(task: Task[Any, Any], run: Run) -> TaskResult[Any, Any] | None:
    """The first enqueue's result; None where its backend cannot fetch it,
    or no longer holds it (django-tasks-db prunes finished results)."""
    bound = _fetchable(task, run)
    if bound is None:
        return None
    try:
        return bound.get_result(run.result["id"])
    except TaskResultDoesNotExist:
        return None


async def _areplayed(task: Task[Any, Any], run: Run) -> TaskResult[Any, Any] | None:
    """``_replayed`` for async code."""
    bound = _fetchable(task, run)
    if bound is None:
        return None
    try:
        return await bound.aget_result(run.result["id"])
    except TaskResultDoesNotExist:
        return None


def enqueue_once(
    task: Task[Any, Any],
    *args: Any,
    key: str | int,
    scope: str = DEFAULT_SCOPE,
    ttl: float | None = None,
    wait: float | None = None,
    **kwargs: Any,
) -> TaskResult[Any, Any] | None:
    """``task.enqueue(*args, **kwargs)`` unless ``key`` (in ``scope``) was
    enqueued before: then the first enqueue's ``TaskResult``, fetched from
    its backend, or None where the backend cannot fetch results (the
    immediate and dummy backends) or no longer holds this one (pruned).

    Raises ``KeyReused`` when the key was enqueued with other arguments, and
    ``KeyInProgress`` when another producer is enqueueing it and has not
    finished within ``wait`` seconds (default: 5, at most half of LEASE).
    The key is remembered for ``ttl`` (default: the ``TTL`` setting).
    """
    scope_, key_, operation, fingerprint = _identity_args(task, key, scope, args, kwargs)
    with once(scope_, key_, operation, fingerprint, ttl=ttl, wait=_wait(wait)) as run:
        if run.should_execute:
            enqueued = task.enqueue(*args, **kwargs)
            run.result = _stored(enqueued)
            fresh: TaskResult[Any, Any] | None = enqueued
    return _replayed(task, run) if run.replayed else fresh


async def aenqueue_once(
    task: Task[Any, Any],
    *args: Any,
    key: str | int,
    scope: str = DEFAULT_SCOPE,
    ttl: float | None = None,
    wait: float | None = None,
    **kwargs: Any,
) -> TaskResult[Any, Any] | None:
    """``enqueue_once`` for async code (``task.aenqueue`` under ``aonce``)."""
    scope_, key_, operation, fingerprint = _identity_args(task, key, scope, args, kwargs)
    async with aonce(scope_, key_, operation, fingerprint, ttl=ttl, wait=_wait(wait)) as run:
        if run.should_execute:
            enqueued = await task.aenqueue(*args, **kwargs)
            run.result = _stored(enqueued)
            fresh: TaskResult[Any, Any] | None = enqueued
    return await _areplayed(task, run) if run.replayed else fresh
