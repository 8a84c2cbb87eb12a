"""The functions on a cursor's way are checked once per unit (a claim, its
work and its completion), not at each statement that could go past the
cursor: an agent is installed as a process starts or between requests.
What the connection itself says is still asked per statement."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connections, transaction

from idempotency_app import service
from idempotency_app.store import postgresql
from tests.store.conftest import is_completion
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:agent-checks-per-unit"


def _unit() -> None:
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            with transaction.atomic():  # a block: its SAVEPOINT may go past the cursor
                Charge.objects.create(label="a")
            run.result = "done"
    assert run.result == "done"


def test_asked_once_per_unit_and_again_for_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []
    functions_own = postgresql._functions_own

    def counting(connection: Any) -> bool:
        asked.append(connection)
        return functions_own(connection)

    monkeypatch.setattr(postgresql, "_functions_own", counting)
    _unit()
    assert len(asked) == 1
    _unit()
    assert len(asked) == 2
    # Outside a unit (the service API's manual claims) it is asked each time.
    postgresql.unseen_by_agents(connections["default"])
    postgresql.unseen_by_agents(connections["default"])
    assert len(asked) == 4


def test_a_query_log_turned_on_inside_the_unit_sees_the_completion() -> None:
    """The connection's own state is asked per statement: a log started by
    the work shows the completion sent after it."""
    connection = connections["default"]
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            Charge.objects.create(label="a")
            connection.force_debug_cursor = True
            run.result = "done"
    try:
        logged = [query["sql"] for query in connection.queries]
    finally:
        connection.force_debug_cursor = False
    assert any(is_completion(sql) for sql in logged), logged
