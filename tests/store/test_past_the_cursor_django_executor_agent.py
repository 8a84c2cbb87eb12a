"""An APM agent that traces Django's statements below
``CursorWrapper.execute`` (patching its executor ``_execute``), or that
swaps Django's ``CursorWrapper`` class for a traced subclass of its own
(``make_cursor`` looks the class up on each call), still sees the claim,
the completion and a block's first SAVEPOINT: none of them goes past the
cursor unless Django's own ``execute`` and ``_execute`` would run them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.backends import utils

from idempotency_app import service
from idempotency_app.store import postgresql
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:past-the-cursor-django-executor"


def traced_executor(traced: list[str]) -> Callable[..., Any]:
    django_execute = utils.CursorWrapper._execute

    def _execute(self: Any, sql: Any, *args: Any) -> Any:
        traced.append(str(sql))
        return django_execute(self, sql, *args)

    return _execute


def patch_executor(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    patch.setattr(utils.CursorWrapper, "_execute", traced_executor(traced))


def swap_the_class(patch: pytest.MonkeyPatch, traced: list[str]) -> None:
    subclass = type("TracedCursorWrapper", (utils.CursorWrapper,), {})
    subclass._execute = traced_executor(traced)  # type: ignore[attr-defined]
    patch.setattr(utils, "CursorWrapper", subclass)


@pytest.fixture(params=[patch_executor, swap_the_class], ids=["executor", "class"])
def traced(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    traced: list[str] = []
    connection.close()
    with pytest.MonkeyPatch.context() as patch:
        request.param(patch, traced)
        try:
            yield traced
        finally:
            connection.close()


def test_the_agent_sees_the_claim_the_completion_and_a_blocks_savepoint(
    traced: list[str],
) -> None:
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            with transaction.atomic():
                Charge.objects.create(label="a")
            run.result = "done"
    assert run.result == "done"
    claims = [sql for sql in traced if postgresql.CLAIM_FUNCTION in sql]
    completions = [sql for sql in traced if "WITH done AS (UPDATE" in sql]
    savepoints = [sql for sql in traced if sql.startswith("SAVEPOINT")]
    assert (len(claims), len(completions), len(savepoints)) == (1, 1, 1), traced
