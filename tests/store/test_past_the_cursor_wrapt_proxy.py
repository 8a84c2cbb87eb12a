"""An agent that wraps a function along a cursor's way with a wrapt-style
``FunctionWrapper`` (an ``ObjectProxy``: wrapt, and with it ddtrace, New
Relic, Elastic APM, ...) installed after the first request warmed the
agent checks' cache. wrapt's proxies forward ``__eq__`` (and every
attribute, ``__code__`` included) to the function they wrap, so the new
key the check built compared equal to the key judged agent-free before,
and the claim, the completion and the block's SAVEPOINT went past the
cursor unseen by the agent that sees every other statement.

The guarantee: the agent sees the claim, the completion and the
block's first SAVEPOINT, as it does when installed before the first
request (``tests/store/test_past_the_cursor_agent_shapes.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db.backends import utils

from idempotency_app.store import base, postgresql
from tests.store.test_past_the_cursor_agent_shapes import an_agent_sees_each_statement
from tests.store.test_past_the_cursor_connection_proxy_agent import TracedCursor

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


class ObjectProxy:
    """What wrapt's ObjectProxy does that matters here: attributes and
    comparisons forwarded to the wrapped object (wrapt.ObjectProxy.__eq__
    is ``return self.__wrapped__ == other``; __hash__ likewise)."""

    def __init__(self, wrapped: Any) -> None:
        object.__setattr__(self, "__wrapped__", wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __eq__(self, other: Any) -> bool:
        return self.__wrapped__ == other

    def __ne__(self, other: Any) -> bool:
        return self.__wrapped__ != other

    def __hash__(self) -> int:
        return hash(self.__wrapped__)


class BoundFunctionWrapper(ObjectProxy):
    def __init__(self, wrapped: Any, instance: Any, wrapper: Any) -> None:
        super().__init__(wrapped)
        object.__setattr__(self, "_self_instance", instance)
        object.__setattr__(self, "_self_wrapper", wrapper)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_wrapper(self.__wrapped__, self._self_instance, args, kwargs)


class FunctionWrapper(ObjectProxy):
    def __init__(self, wrapped: Any, wrapper: Any) -> None:
        super().__init__(wrapped)
        object.__setattr__(self, "_self_wrapper", wrapper)

    def __get__(self, instance: Any, owner: Any) -> Any:
        bound = self.__wrapped__.__get__(instance, owner)
        return BoundFunctionWrapper(bound, instance, self._self_wrapper)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_wrapper(self.__wrapped__, None, args, kwargs)


def wrapt_execute(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """wrapt.wrap_function_wrapper(utils, "CursorWrapper.execute", ...)"""

    def tracer(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        traced.append(str(args[0]))
        return wrapped(*args, **kwargs)

    original = vars(utils.CursorWrapper)["execute"]
    patch.setattr(utils.CursorWrapper, "execute", FunctionWrapper(original, tracer))


def wrapt_psycopg_cursor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    """wrapt.wrap_function_wrapper(psycopg, "Connection.cursor", ...)"""
    import psycopg

    def tracer(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return TracedCursor(wrapped(*args, **kwargs), traced)

    original = vars(psycopg.Connection)["cursor"]
    patch.setattr(psycopg.Connection, "cursor", FunctionWrapper(original, tracer))


AGENTS = [wrapt_execute, wrapt_psycopg_cursor]


@pytest.mark.parametrize("warmed", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("agent", AGENTS, ids=[a.__name__ for a in AGENTS])
def test_a_wrapt_agent_installed_after_the_first_request_sees_the_claim(
    agent: Any, warmed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh process: nothing judged yet (another test's keys would decide).
    monkeypatch.setattr(postgresql, "_AGENT_FREE", base.Judgements(postgresql._agent_free))
    an_agent_sees_each_statement(agent, warmed)
