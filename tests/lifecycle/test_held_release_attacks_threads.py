"""Held releases and threads that copy the work's context: a helper thread's
connection never sends the work's releases."""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections, transaction

from tests.lifecycle.test_held_release_attacks import LAST, same
from tests.savepoints import savepoint
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def _side(out: list) -> None:
    try:
        out.append(Charge.objects.count())
    except Exception as exc:
        out.append(repr(exc))
    finally:
        connections.close_all()


def test_thread_with_copied_context_reads_after_a_held_release() -> None:
    """A helper thread run with the work's context copied (asgiref's
    sync_to_async(thread_sensitive=False) and copy_context().run do so):
    its own connection's raw cursor flushes the work's held releases."""

    def work() -> str:
        Charge.objects.create(label="a")
        with transaction.atomic():
            Charge.objects.create(label="b")
        out: list = []
        ctx = contextvars.copy_context()
        t = threading.Thread(target=ctx.run, args=(_side, out))
        t.start()
        t.join()
        seen.append(out[0])
        Charge.objects.create(label="c")
        return "ok"

    seen: list = []
    plain, keyed = same(work)
    print(seen, LAST.get("exc"))
    assert plain == ("ok", ["a", "b", "c"])
    assert keyed == plain, (seen, LAST.get("exc"))
    assert seen[0] == seen[1], seen


def test_thread_with_copied_context_no_held_release() -> None:
    def work() -> str:
        Charge.objects.create(label="a")
        out: list = []
        ctx = contextvars.copy_context()
        t = threading.Thread(target=ctx.run, args=(_side, out))
        t.start()
        t.join()
        seen.append(out[0])
        return "ok"

    seen: list = []
    plain, keyed = same(work)
    assert keyed == plain, (seen, LAST.get("exc"))
    assert seen[0] == seen[1], seen


def test_refused_release_swallowed_by_a_helper_threads_connection() -> None:
    """A second savepoint_commit of one savepoint fails where it is called
    without a key. Under a key both releases are held; a helper thread run
    with the work's context copied flushes them on its own connection
    (autocommit: 25P01, not 3B001), so the bad release never reaches the
    work's connection and no refusal is recorded."""

    def work() -> str:
        Charge.objects.create(label="a")
        sid = savepoint()
        Charge.objects.create(label="b")
        transaction.savepoint_commit(sid)
        transaction.savepoint_commit(sid)  # plain: 3B001 here
        out: list = []
        with ThreadPoolExecutor(1) as pool:
            ctx = contextvars.copy_context()
            pool.submit(ctx.run, _side, out).result()
        seen.append(out[0])
        Charge.objects.create(label="c")
        return "ok"

    seen: list = []
    plain, keyed = same(work)
    print(plain, keyed, seen, LAST.get("exc"))
    assert plain[0].startswith("raised"), plain
    assert keyed[0].startswith("raised"), (keyed, seen, LAST.get("rec") and LAST["rec"].status)


def test_refused_release_swallowed_via_asgiref_sync_to_async_thread_insensitive() -> None:
    from asgiref.sync import async_to_sync, sync_to_async

    def work() -> str:
        Charge.objects.create(label="a")
        sid = savepoint()
        Charge.objects.create(label="b")
        transaction.savepoint_commit(sid)
        transaction.savepoint_commit(sid)  # plain: 3B001 here
        out: list = []

        async def helper() -> None:
            await sync_to_async(_side, thread_sensitive=False)(out)

        async_to_sync(helper)()
        seen.append(out[0])
        Charge.objects.create(label="c")
        return "ok"

    seen: list = []
    plain, keyed = same(work)
    print(plain, keyed, seen, LAST.get("exc"))
    assert plain[0].startswith("raised"), plain
    assert keyed[0].startswith("raised"), (keyed, seen, LAST.get("rec") and LAST["rec"].status)
