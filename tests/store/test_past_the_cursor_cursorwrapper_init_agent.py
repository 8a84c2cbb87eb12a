"""An agent that patches ``CursorWrapper.__init__`` so that every Django
cursor holds a tracing proxy around the driver's cursor (the "wrap the
cursor where it is made" shape; ``__init__`` is on the way of every
statement Django sends: ``make_cursor`` calls it). ``execute``,
``_execute_with_wrappers``, ``_execute``, ``make_cursor`` and
``create_cursor`` all stay Django's own, so the agent checks judged the
way agent-free and the claim, the completion and a block's first
SAVEPOINT went past the cursor, unseen by an agent that sees every other
statement.

The guarantee: the agent sees the library's statements too (an
agent-replaced ``CursorWrapper.__init__`` takes the cursor's way)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.backends import utils

from tests.store.test_past_the_cursor_agent_shapes import one_request, saw_each_statement_once
from tests.store.test_past_the_cursor_connection_proxy_agent import TracedCursor

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


@pytest.mark.parametrize("warmed", [False, True], ids=["before", "after"])
def test_an_agent_wrapping_the_cursor_in_cursorwrapper_init_sees_the_claim(warmed: bool) -> None:
    if warmed:
        one_request()
    traced: list[str] = []
    original = utils.CursorWrapper.__init__

    def __init__(self: Any, cursor: Any, db: Any) -> None:
        original(self, TracedCursor(cursor, traced), db)

    connection.close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utils.CursorWrapper, "__init__", __init__)
        try:
            one_request()
        finally:
            connection.close()
    saw_each_statement_once(traced)
