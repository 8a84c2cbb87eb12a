"""Firing one request from many threads and processes at once.

Each thread uses its own database connection (Django's are thread-local)
and closes it when done; forked children start with none, because the
parent closes its own before forking.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from django.contrib.auth.models import User
from django.db import connections
from rest_framework.test import APIClient


def post_as(user_pk: int, url: str, data: Any, key: str) -> int:
    client = APIClient()
    client.force_authenticate(User.objects.get(pk=user_pk))
    response = client.post(url, data, format="json", HTTP_IDEMPOTENCY_KEY=key)
    if response.status_code >= 500:
        return response.status_code
    if response.get("Idempotent-Replayed") == "true":
        return -response.status_code  # negative: a replay of that status
    return response.status_code


def in_threads(count: int, target: Callable[[], Any]) -> list[Any]:
    """Run ``target`` in ``count`` threads released together by a barrier;
    their results (or the exceptions they raised) in thread order."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def worker(index: int) -> None:
        try:
            barrier.wait()
            results[index] = target()
        except Exception as exc:  # returned, so the test sees it
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def fire_threads(count: int, user_pk: int, url: str, data: Any, key: str) -> list[int]:
    """``count`` threads posting at once; their outcomes (599: it raised)."""
    results = in_threads(count, lambda: post_as(user_pk, url, data, key))
    return [599 if isinstance(result, Exception) else result for result in results]


def _child(
    queue: Any, threads: int, user_pk: int, url: str, data: Any, key: str, start: Any
) -> None:
    start.wait()
    queue.put(fire_threads(threads, user_pk, url, data, key))


def fire_processes(
    processes: int, threads: int, user_pk: int, url: str, data: Any, key: str
) -> list[int]:
    context = multiprocessing.get_context("fork")
    connections.close_all()
    queue = context.Queue()
    start = context.Event()
    children = [
        context.Process(target=_child, args=(queue, threads, user_pk, url, data, key, start))
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    start.set()
    results: list[int] = []
    for _ in children:
        results.extend(queue.get(timeout=180))
    for child in children:
        child.join(timeout=30)
    return results
