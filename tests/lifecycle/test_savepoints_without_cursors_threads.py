"""Savepoints without cursors: blocks in async work (aonce) and in work on
several threads."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import IntegrityError, connections, transaction

from idempotency_app import service
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def _blocks(tag: str) -> str:
    with transaction.atomic():
        c = Charge.objects.create(label=f"{tag}-a")
        try:
            with transaction.atomic():
                with transaction.atomic():
                    Charge.objects.create(label=f"{tag}-gone")
                Charge.objects.create(id=c.id, label="dup")
        except IntegrityError:
            pass
        with transaction.atomic():
            Charge.objects.create(label=f"{tag}-b")
    assert "_savepoint" in vars(connections["default"]) or True
    return tag


def test_aonce_with_blocks_in_sync_to_async() -> None:
    key = str(uuid.uuid4())

    async def main() -> Any:
        async with service.aonce(
            "tests:savepoints-without-cursors", key, "tests.savepoints_without_cursors"
        ) as run:
            if run.should_execute:
                run.result = await sync_to_async(_blocks)("x")
                await Charge.objects.acreate(label="x-c")
        return run.result

    assert asyncio.run(main()) == "x"
    assert labels() == ["x-a", "x-b", "x-c"]
    assert asyncio.run(main()) == "x"
    assert labels() == ["x-a", "x-b", "x-c"]

    def check() -> Any:
        c = connections["default"]
        return "_savepoint" in vars(c), "_savepoint_commit" in vars(c)

    assert asyncio.run(sync_to_async(check)()) == (False, False)
    asyncio.run(sync_to_async(connections.close_all)())


def test_threads_each_with_work_and_blocks() -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run(i: int) -> None:
        try:
            barrier.wait()
            for n in range(5):
                with service.once(
                    "tests:savepoints-without-cursors",
                    f"{i}-{n}-{uuid.uuid4()}",
                    "tests.savepoints_without_cursors",
                ) as r:
                    if r.should_execute:
                        r.result = _blocks(f"t{i}n{n}")
                c = connections["default"]
                assert "_savepoint" not in vars(c)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = labels()
    assert len(got) == 8 * 5 * 2
    assert not any("gone" in g for g in got)
    assert IdempotencyRecord.objects.count() == 40
