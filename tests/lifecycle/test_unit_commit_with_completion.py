"""Where the COMMIT goes in one message with the completion (PostgreSQL),
the unit's block records the commit Django's own would have found
nothing to send for: the hooks, the connection's state and the next
request are as after Django's commit."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connections, transaction

from idempotency_app import service
from idempotency_app.exceptions import WorkRolledBack
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True)]

SCOPE = "tests:commit-with-completion"


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


@pytest.mark.postgresql
def test_the_commit_sent_with_the_completion_is_not_asked_of_django_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connection = connections["default"]
    connection.ensure_connection()
    commits: list[str] = []
    commit = connection.commit

    def counting() -> None:
        commits.append("commit")
        commit()

    monkeypatch.setattr(connection, "commit", counting)
    assert _once(lambda: Charge.objects.create(label="one").label) == "one"
    assert commits == []
    # Marked for rollback, the unit is Django's to end.
    with pytest.raises(WorkRolledBack), service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            Charge.objects.create(label="rolled back")
            transaction.set_rollback(True)
            run.result = "done"
    assert list(Charge.objects.values_list("label", flat=True)) == ["one"]
    assert connection.get_autocommit() and not connection.in_atomic_block
