"""A thread the work starts with its context copied (``copy_context().run``,
asgiref's ``sync_to_async(thread_sensitive=False)``) talks to the claim's
database through a connection of its own, in autocommit, and so does a
connection the work opens by hand: a write there would commit at once,
without the work's outcome, and run again on a retry. It is refused as a
write to another database is, and the work fails even if the thread
swallows the refusal; a read there runs. The work's own connection, shared
with another thread, is still the work's."""

from __future__ import annotations

import contextvars
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connections

from idempotency_app import service
from idempotency_app.exceptions import CannotBeAtomic
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]

SCOPE = "tests:work-in-threads"


def copied_context(call: Callable[[], None]) -> None:
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(call,))
    thread.start()
    thread.join()


def thread_insensitive(call: Callable[[], None]) -> None:
    async def helper() -> None:
        await sync_to_async(call, thread_sensitive=False)()

    async_to_sync(helper)()


STARTS = [copied_context, thread_insensitive]


def in_a_thread(start: Callable[[Callable[[], None]], None], task: Callable[[], Any]) -> list[Any]:
    """What ``task`` returned or raised, run by ``start`` in another thread."""
    out: list[Any] = []

    def call() -> None:
        try:
            out.append(task())
        except Exception as exc:  # swallowed, as a careless helper would
            out.append(exc)
        finally:
            connections.close_all()

    start(call)
    return out


@pytest.mark.parametrize("start", STARTS, ids=lambda f: f.__name__)
def test_a_write_from_the_thread_is_refused_and_fails_the_work(
    start: Callable[[Callable[[], None]], None],
) -> None:
    key = str(uuid.uuid4())
    seen: list[Any] = []
    with (
        pytest.raises(CannotBeAtomic, match="another connection"),
        service.once(SCOPE, key, "op") as run,
    ):
        if run.should_execute:
            Charge.objects.create(label="work")
            seen += in_a_thread(start, lambda: Charge.objects.create(label="thread"))
            run.result = "done"
    assert isinstance(seen[0], CannotBeAtomic), seen
    assert list(Charge.objects.values_list("label", flat=True)) == []
    with service.once(SCOPE, key, "op") as retry:  # the key was let go: the retry runs
        assert retry.should_execute
        retry.result = "again"


@pytest.mark.parametrize("start", STARTS, ids=lambda f: f.__name__)
def test_a_read_from_the_thread_runs(start: Callable[[Callable[[], None]], None]) -> None:
    Charge.objects.create(label="committed")
    seen: list[Any] = []
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            Charge.objects.create(label="work")
            seen += in_a_thread(start, lambda: Charge.objects.count())
            run.result = "done"
    assert seen == [1]  # the work's own write is not committed yet
    assert sorted(Charge.objects.values_list("label", flat=True)) == ["committed", "work"]


def test_a_write_through_a_connection_opened_by_hand_is_refused() -> None:
    key = str(uuid.uuid4())
    with (
        pytest.raises(CannotBeAtomic, match="another connection"),
        service.once(SCOPE, key, "op") as run,
    ):
        if run.should_execute:
            Charge.objects.create(label="work")
            side = connections.create_connection("default")
            try:
                with side.cursor() as cursor:
                    cursor.execute("INSERT INTO testapp_charge (label, amount) VALUES ('side', 1)")
            finally:
                side.close()
            run.result = "done"
    assert list(Charge.objects.values_list("label", flat=True)) == []


def test_the_works_own_connection_shared_with_a_thread_is_the_works() -> None:
    """Django lets a connection be shared (``inc_thread_sharing``): what
    another thread sends through it is part of the work's transaction."""
    own = connections["default"]
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            Charge.objects.create(label="work")
            own.inc_thread_sharing()
            try:
                done = in_a_thread(copied_context, lambda: shared_insert(own))
            finally:
                own.dec_thread_sharing()
            run.result = "done"
    assert done == [None] and run.result == "done"
    assert sorted(Charge.objects.values_list("label", flat=True)) == ["shared", "work"]


def shared_insert(own: Any) -> None:
    with own.cursor() as cursor:
        cursor.execute("INSERT INTO testapp_charge (label, amount) VALUES ('shared', 1)")


def test_the_works_connection_behind_an_agents_proxy_is_the_works() -> None:
    """An APM agent's proxy around the driver connection (Elastic APM's,
    New Relic's) hands out the driver's own cursors: their statements are
    on the work's session, not another connection's."""
    from tests.store.test_past_the_cursor_connection_proxy_agent import TracedConnection

    traced: list[str] = []
    wrapper_class = type(connections["default"])
    connect = wrapper_class.get_new_connection

    def get_new_connection(self: Any, params: Any) -> Any:
        return TracedConnection(connect(self, params), traced)

    connections["default"].close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wrapper_class, "get_new_connection", get_new_connection)
        try:
            with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
                if run.should_execute:
                    Charge.objects.create(label="work")
                    run.result = "done"
        finally:
            connections["default"].close()
    assert run.result == "done" and any("INSERT" in sql for sql in traced), traced
    assert list(Charge.objects.values_list("label", flat=True)) == ["work"]
