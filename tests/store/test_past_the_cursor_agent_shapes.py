"""An agent that traces Django's statements anywhere along a cursor's way
(Django's ``_execute_with_wrappers``, ``create_cursor`` or
``BaseDatabaseWrapper.cursor``, psycopg's ``Connection.cursor``, or a
function's code rewritten in place as ddtrace does) sees the claim, the
completion and a block's first SAVEPOINT, installed before the first
request or after it warmed every cache: none goes past the cursor, and
the kept cursor is not kept past an agent's ``cursor()``. So does one that
patches only ``CursorWrapper._execute`` or swaps in a ``CursorWrapper``
subclass of its own (``make_cursor`` looks the class up on each call)."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.backends import utils

from idempotency_app import service
from idempotency_app.store import postgresql
from tests.store.conftest import is_completion
from tests.store.test_past_the_cursor_connection_proxy_agent import TracedCursor
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:past-the-cursor-agent-shapes"


def one_request() -> None:
    """A keyed unit whose work has a block: a claim, a SAVEPOINT, an INSERT
    and a completion, each of which an agent must see."""
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            with transaction.atomic():
                Charge.objects.create(label="a")
            run.result = "done"
    assert run.result == "done"


def saw_each_statement_once(traced: list[str]) -> None:
    assert any("INSERT" in s and "charge" in s.lower() for s in traced), traced
    claims = [s for s in traced if postgresql.CLAIM_FUNCTION in s]
    completions = [s for s in traced if is_completion(s)]
    savepoints = [s for s in traced if s.startswith("SAVEPOINT")]
    assert (len(claims), len(completions), len(savepoints)) == (1, 1, 1), traced


def agent_execute_with_wrappers(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """Django's CursorWrapper._execute_with_wrappers wrapped (the one method
    every execute/executemany goes through)."""
    original = utils.CursorWrapper._execute_with_wrappers

    def _execute_with_wrappers(self: Any, sql: Any, *args: Any, **kwargs: Any) -> Any:
        traced.append(str(sql))
        return original(self, sql, *args, **kwargs)

    patch.setattr(utils.CursorWrapper, "_execute_with_wrappers", _execute_with_wrappers)


def agent_psycopg_connection_cursor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """psycopg.Connection.cursor patched on the class: traced cursors handed
    out, the connection's class, cursor_factory and Cursor.execute untouched."""
    import psycopg

    original = psycopg.Connection.cursor

    def cursor(self: Any, *args: Any, **kwargs: Any) -> Any:
        return TracedCursor(original(self, *args, **kwargs), traced)

    patch.setattr(psycopg.Connection, "cursor", cursor)


def agent_django_create_cursor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """Django's postgresql DatabaseWrapper.create_cursor patched on the class."""
    from django.db import connections

    wrapper_class = type(connections["default"])
    original = wrapper_class.create_cursor

    def create_cursor(self: Any, name: Any = None) -> Any:
        return TracedCursor(original(self, name), traced)

    patch.setattr(wrapper_class, "create_cursor", create_cursor)


def agent_base_cursor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """BaseDatabaseWrapper.cursor itself wrapped (so every backend's cursor())."""
    from django.db.backends.base.base import BaseDatabaseWrapper

    original = BaseDatabaseWrapper.cursor

    def cursor(self: Any) -> Any:
        wrapper = original(self)
        wrapper.cursor = TracedCursor(wrapper.cursor, traced)
        return wrapper

    patch.setattr(BaseDatabaseWrapper, "cursor", cursor)


def agent_code_patched(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """A bytecode-wrapping agent (ddtrace's internal ``wrapping.wrap``): the
    function object stays the same, its ``__code__`` is replaced."""
    function = utils.CursorWrapper.execute
    saved = function.__code__
    copy = type(function)(saved, function.__globals__, "execute_orig", function.__defaults__)
    function.__globals__["_agent_traced"] = traced
    function.__globals__["_agent_original"] = copy

    def execute(self: Any, sql: Any, params: Any = None) -> Any:
        _agent_traced.append(str(sql))  # type: ignore[name-defined]  # noqa: F821
        return _agent_original(self, sql, params)  # type: ignore[name-defined]  # noqa: F821

    patch.setattr(function, "__code__", execute.__code__)


def agent_wraps_create_cursor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """The backend's create_cursor wrapped with functools.wraps: its
    ``__wrapped__`` is Django's own, as Django's async_unsafe leaves it."""
    from django.db import connections

    wrapper_class = type(connections["default"])
    original = wrapper_class.create_cursor

    @functools.wraps(original)
    def create_cursor(self: Any, name: Any = None) -> Any:
        return TracedCursor(original(self, name), traced)

    patch.setattr(wrapper_class, "create_cursor", create_cursor)


def agent_wraps_base_cursor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """BaseDatabaseWrapper.cursor wrapped with functools.wraps."""
    from django.db.backends.base.base import BaseDatabaseWrapper

    original = BaseDatabaseWrapper.cursor

    @functools.wraps(original)
    def cursor(self: Any) -> Any:
        wrapper = original(self)
        wrapper.cursor = TracedCursor(wrapper.cursor, traced)
        return wrapper

    patch.setattr(BaseDatabaseWrapper, "cursor", cursor)


def traced_executor(traced: list[str]) -> Any:
    django_execute = utils.CursorWrapper._execute  # type: ignore[attr-defined]

    def _execute(self: Any, sql: Any, *args: Any) -> Any:
        traced.append(str(sql))
        return django_execute(self, sql, *args)

    return _execute


def agent_patches_the_executor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """Django's CursorWrapper._execute patched, its execute left alone."""
    patch.setattr(utils.CursorWrapper, "_execute", traced_executor(traced))


def agent_swaps_the_class(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """Django's CursorWrapper swapped for a traced subclass (make_cursor
    looks the class up on its module at each call)."""
    subclass = type("TracedCursorWrapper", (utils.CursorWrapper,), {})
    subclass._execute = traced_executor(traced)  # type: ignore[attr-defined]
    patch.setattr(utils, "CursorWrapper", subclass)


AGENTS = [
    agent_execute_with_wrappers,
    agent_psycopg_connection_cursor,
    agent_django_create_cursor,
    agent_base_cursor,
    agent_code_patched,
    agent_wraps_create_cursor,
    agent_wraps_base_cursor,
    agent_patches_the_executor,
    agent_swaps_the_class,
]


@pytest.mark.parametrize("warmed", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("agent", AGENTS, ids=[a.__name__ for a in AGENTS])
def test_an_agent_installed_before_or_after_the_first_request_sees_the_claim(
    agent: Any, warmed: bool
) -> None:
    an_agent_sees_each_statement(agent, warmed)


def an_agent_sees_each_statement(agent: Any, warmed: bool) -> None:
    """``agent`` installed on a new connection, before the first request or
    after it warmed every cache, sees each of the next one's statements."""
    if warmed:
        one_request()
    traced: list[str] = []
    connection.close()
    with pytest.MonkeyPatch.context() as patch:
        agent(patch, traced)
        try:
            one_request()
        finally:
            connection.close()
    saw_each_statement_once(traced)
