"""The statement guard takes down exactly what it put up, whatever the work
does to the connections' execute wrappers and savepoint hooks, and the
mark that a claim's work is running is always reset: a guard left behind
would judge every later statement of the thread as the work's."""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.db import connection, connections, transaction
from django.utils.connection import ConnectionDoesNotExist

from idempotency_app import service
from idempotency_app.exceptions import CannotBeAtomic
from idempotency_app.lifecycle import units, work
from tests.concurrency import in_threads
from tests.testapp.models import AuditEntry, Charge

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])

SCOPE = "work-cleanup"


def new_key() -> str:
    return str(uuid.uuid4())


def clean() -> None:
    """Nothing of any work left behind in this thread."""
    for alias in settings.DATABASES:
        if alias in connections.settings:
            assert connections[alias].execute_wrappers == [], alias
    conn = connections["default"]
    assert "_savepoint" not in vars(conn)
    assert "_savepoint_commit" not in vars(conn)
    assert work._work.get() is None
    assert dict(units._running.get()) == {}


def runs_normally(key: str) -> None:
    """A later once() under the key runs the work (not as nested) and stores it."""
    with service.once(SCOPE, key, "op") as run:
        assert run.should_execute
        Charge.objects.create(label="later")
        run.result = "ok"
    clean()
    with service.once(SCOPE, key, "op") as run:
        assert not run.should_execute, "stored: a replay"
    assert run.result == "ok"


def later_writes_work() -> None:
    """Writes on both databases, outside any work, are not judged."""
    Charge.objects.create(label="outside")
    AuditEntry.objects.using("other").create(note="outside")
    with transaction.atomic():
        Charge.objects.create(label="outside-atomic")


class Boom(Exception):
    pass


def scrub() -> None:
    """Whatever a broken test leaves on the connections goes, so that the
    database teardown is not judged by a stale guard."""
    for alias in ("default", "other"):
        connections[alias].execute_wrappers.clear()
        for name in ("_savepoint", "_savepoint_commit"):
            vars(connections[alias]).pop(name, None)
    work._work.set(None)


@pytest.fixture(autouse=True)
def _scrub() -> Any:
    yield
    scrub()


# -- the work raising ----------------------------------------------------------


@pytest.mark.parametrize("in_callers_atomic", [False, True])
def test_work_raises(in_callers_atomic: bool) -> None:
    key = new_key()
    outer = transaction.atomic() if in_callers_atomic else contextlib.nullcontext()
    with pytest.raises(Boom), outer, service.once(SCOPE, key, "op") as run:
        assert run.should_execute
        Charge.objects.create(label="x")
        raise Boom
    clean()
    later_writes_work()
    runs_normally(key)


def test_work_raises_base_exception() -> None:
    key = new_key()
    with pytest.raises(KeyboardInterrupt), service.once(SCOPE, key, "op"):
        Charge.objects.create(label="x")
        raise KeyboardInterrupt
    clean()
    runs_normally(key)


# -- the work pushing and popping wrappers of its own -------------------------------


def test_work_with_its_own_balanced_wrapper_that_raises() -> None:
    seen: list[str] = []

    def mine(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    key = new_key()
    with (
        pytest.raises(Boom),
        service.once(SCOPE, key, "op"),
        connections["other"].execute_wrapper(mine),
        connection.execute_wrapper(mine),
    ):
        Charge.objects.create(label="x")
        raise Boom
    assert seen
    clean()
    later_writes_work()
    runs_normally(key)


def test_work_that_removes_the_wrappers_it_found_on_another_database() -> None:
    """The work empties another database's wrappers (as code that mutes all
    instrumentation for a moment and fails before putting it back does).
    The old ExitStack still took the guard off every other connection and
    reset the work's context; a bare pop() loop stops at the first failing
    pop."""
    key = new_key()
    with (
        pytest.raises(CannotBeAtomic, match="took the statement guard off"),
        service.once(SCOPE, key, "op") as run,
    ):
        Charge.objects.create(label="x")
        connections["other"].execute_wrappers.clear()
        run.result = "done"
    # the guard of the claim's database must not outlive the work
    assert connections["default"].execute_wrappers == []
    assert work._work.get() is None
    later_writes_work()


def test_work_that_pops_a_wrapper_it_never_pushed_on_the_claims_database() -> None:
    """The work pops one wrapper too many on the claim's database (the
    guard itself). The guard on 'other' must still come off."""
    key = new_key()
    with (
        pytest.raises(CannotBeAtomic, match="took the statement guard off"),
        service.once(SCOPE, key, "op") as run,
    ):
        Charge.objects.create(label="x")
        connection.execute_wrappers.pop()
        run.result = "done"
    assert connections["other"].execute_wrappers == []
    assert connections["default"].execute_wrappers == []
    assert work._work.get() is None
    later_writes_work()


def test_work_that_leaks_a_wrapper_on_another_database() -> None:
    """The work pushes a wrapper on 'other' and never pops it (an exit stack
    closed later, an agent's patch). confined() pops positionally (as
    Django's execute_wrapper() does), so it takes the leaked wrapper off
    and leaves its own guard: every later write to 'other' in this thread
    is then refused as a write from inside work."""
    leaked: list[Any] = []

    def mine(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        return execute(sql, params, many, context)

    key = new_key()
    with service.once(SCOPE, key, "op") as run:
        Charge.objects.create(label="x")
        connections["other"].execute_wrappers.append(mine)
        leaked.append(mine)
        run.result = "done"
    wrappers = connections["other"].execute_wrappers
    try:
        assert all(w is mine for w in wrappers), f"a guard outlived the work: {wrappers}"
        AuditEntry.objects.using("other").create(note="after the work")
    finally:
        wrappers.clear()


def test_work_that_leaks_a_wrapper_on_the_claims_database() -> None:
    def mine(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        return execute(sql, params, many, context)

    key = new_key()
    try:
        with service.once(SCOPE, key, "op") as run:
            Charge.objects.create(label="x")
            connection.execute_wrappers.append(mine)
            run.result = "done"
        wrappers = list(connection.execute_wrappers)
        assert all(w is mine for w in wrappers), f"a guard outlived the work: {wrappers}"
    finally:
        connection.execute_wrappers.clear()


# -- confined() failing as it installs ----------------------------------------------


def test_an_alias_in_databases_that_connections_does_not_know() -> None:
    """connections[alias] raises for the third alias: what was installed for
    the first two comes off, the running mark is reset."""
    key = new_key()
    databases = {**settings.DATABASES, "ghost": {**settings.DATABASES["other"]}}
    with mock.patch.object(settings, "DATABASES", databases):
        assert "ghost" not in connections.settings
        with pytest.raises(ConnectionDoesNotExist), service.once(SCOPE, key, "op"):
            pytest.fail("the work must not run")
    clean()
    later_writes_work()
    runs_normally(key)


@pytest.mark.parametrize(
    ("target", "name"),
    [(work._WorkState, "__init__"), (work, "_savepoints_without_cursors")],
    ids=["confined raising on entry", "savepoint hooks failing to install"],
)
def test_the_guard_failing_on_entry_leaves_nothing(target: Any, name: str) -> None:
    """The running mark is reset and nothing stays on the connections; the
    savepoint hooks are PostgreSQL's."""
    if name == "_savepoints_without_cursors" and connection.vendor != "postgresql":
        pytest.skip("the hooks are PostgreSQL's")
    key = new_key()
    with (
        mock.patch.object(target, name, side_effect=Boom),
        pytest.raises(Boom),
        service.once(SCOPE, key, "op"),
    ):
        pytest.fail("the work must not run")
    clean()
    runs_normally(key)


# -- nesting --------------------------------------------------------------------


def test_nested_once_same_key_then_different_key_failing() -> None:
    key, inner = new_key(), new_key()
    with service.once(SCOPE, key, "op") as run:
        assert run.should_execute
        with service.once(SCOPE, key, "op") as again:
            assert again.should_execute  # part of the same run
        with pytest.raises(Boom), service.once(SCOPE, inner, "op") as nested:
            assert nested.should_execute
            Charge.objects.create(label="inner")
            raise Boom
        # the outer work's guard is still on
        assert connection.execute_wrappers and connections["other"].execute_wrappers
        assert work._work.get() is not None
        assert units.running(run.identity, "default") is not None
        Charge.objects.create(label="outer")
        run.result = "outer"
    clean()
    assert sorted(Charge.objects.values_list("label", flat=True)) == ["outer"]
    runs_normally(inner)


def test_nested_once_inner_succeeds_outer_raises() -> None:
    key, inner = new_key(), new_key()
    with pytest.raises(Boom), service.once(SCOPE, key, "op"):
        with service.once(SCOPE, inner, "op") as nested:
            Charge.objects.create(label="inner")
            nested.result = "inner"
        raise Boom
    clean()
    assert Charge.objects.count() == 0
    runs_normally(key)
    runs_normally(inner)


# -- threads --------------------------------------------------------------------


def test_threads_each_leave_their_connections_clean() -> None:
    if connection.vendor == "sqlite":
        pytest.skip("in-memory SQLite is one connection shared by the threads")

    def worker() -> None:
        for j in range(5):
            try:
                with service.once(SCOPE, new_key(), "op") as run:
                    Charge.objects.create(label=f"t{threading.get_ident()}-{j}")
                    if j % 2:
                        raise Boom
                    run.result = j
            except Boom:
                pass
        clean()

    errors = [result for result in in_threads(4, worker) if isinstance(result, Exception)]
    assert errors == []
    clean()


def test_work_that_deletes_a_savepoint_hook() -> None:
    """PostgreSQL: the work deletes the savepoint hook the guard put on its
    connection. Its blocks then go through Django's own (and the guard's
    wrapper), so it succeeds; everything still comes off."""
    if connection.vendor != "postgresql":
        pytest.skip("the hooks are PostgreSQL's")
    key = new_key()
    with service.once(SCOPE, key, "op") as run:
        Charge.objects.create(label="x")
        if "_savepoint_commit" not in vars(connections["default"]):
            pytest.skip("the hooks were not installed in this configuration")
        del connection._savepoint_commit
        with transaction.atomic():
            Charge.objects.create(label="in a block")
        run.result = "done"
    clean()
    assert Charge.objects.filter(label="in a block").exists()
