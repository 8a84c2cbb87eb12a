"""A unit's commit, sent with its completion on PostgreSQL, leaves the
connection as Django's commit does: its on_commit hooks run once, a hook
that raises is Django's to report, and the connection is back in
autocommit for the next request."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connections, transaction

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True)]

SCOPE = "tests:unit-commit-hooks"


def _once(work: Any) -> Any:
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            run.result = work()
    return run.result


def test_on_commit_hooks_run_once_and_the_connection_is_left_in_autocommit() -> None:
    ran: list[str] = []

    def work() -> str:
        Charge.objects.create(label="first")
        transaction.on_commit(lambda: ran.append("hook"))
        return "done"

    assert _once(work) == "done"
    assert ran == ["hook"]
    connection = connections["default"]
    assert connection.get_autocommit()
    assert not connection.in_atomic_block and connection.atomic_blocks == []
    assert connection.run_on_commit == []
    # The next unit and a statement outside any unit run as usual.
    assert _once(lambda: Charge.objects.create(label="second").label) == "second"
    assert sorted(Charge.objects.values_list("label", flat=True)) == ["first", "second"]


def test_a_hook_that_raises_is_django_s_to_report() -> None:
    """As after Django's commit: the work is committed and stored, and the
    hook's error reaches the caller."""
    key = str(uuid.uuid4())

    def fail() -> None:
        raise RuntimeError("the hook failed")

    with (
        pytest.raises(RuntimeError, match="the hook failed"),
        service.once(SCOPE, key, "op") as run,
    ):
        if run.should_execute:
            Charge.objects.create(label="kept")
            transaction.on_commit(fail)
            run.result = "done"
    assert list(Charge.objects.values_list("label", flat=True)) == ["kept"]
    assert connections["default"].get_autocommit()
    with service.once(SCOPE, key, "op") as again:
        assert not again.should_execute
        assert again.result == "done"
