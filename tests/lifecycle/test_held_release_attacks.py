"""Held releases and the cached connection: a refused release, the work's own
missing savepoint, closing the connection mid-work."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction

from idempotency_app import service
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels
from tests.savepoints import savepoint
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:held-release-attacks"


def once(key: str, work: Callable[[], Any]) -> Any:
    with service.once(SCOPE, key, "tests.held_release_attacks") as run:
        if run.should_execute:
            run.result = work()
    return run.result


LAST: dict[str, Any] = {}


def outcome(work: Callable[[], Any], keyed: bool) -> tuple[Any, list[str]]:
    key = str(uuid.uuid4())
    try:
        if keyed:
            result: Any = once(key, work)
        else:
            with transaction.atomic():
                result = work()
    except Exception as exc:
        LAST["exc"] = exc
        result = f"raised {type(exc).__name__}"
    committed = labels()
    Charge.objects.all().delete()
    if keyed:
        rec = IdempotencyRecord.objects.filter(key=key).first()
        LAST["rec"] = rec
        if isinstance(result, str) and result.startswith("raised"):
            assert rec is None or rec.status != "completed", (result, rec and rec.status)
    return result, committed


def same(work: Callable[[], Any]) -> tuple[Any, Any]:
    plain = outcome(work, keyed=False)
    keyed = outcome(work, keyed=True)
    return plain, keyed


# -- (a) false positive: the carrying statement itself fails with 3B001 -------


@pytest.mark.parametrize(
    ("statement", "held"),
    [
        ("ROLLBACK TO SAVEPOINT no_such_savepoint", True),
        ("RELEASE SAVEPOINT maybe_gone", True),
        ("ROLLBACK TO SAVEPOINT no_such_savepoint", False),  # the control: nothing held
    ],
)
def test_the_works_own_missing_savepoint_caught_in_a_block(statement: str, held: bool) -> None:
    """A statement of the work's own fails with 3B001 inside a block that
    rolls back and is caught, with a good release held in front of it (an
    inner block done) or none: the statement's own error is not blamed on
    the held release."""

    def work() -> str:
        Charge.objects.create(label="a")
        try:
            with transaction.atomic():
                if held:
                    with transaction.atomic():
                        Charge.objects.create(label="b")
                else:
                    Charge.objects.create(label="b")
                with connection.cursor() as c:
                    c.execute(statement)  # carries the held release, if any
        except DatabaseError:
            pass
        Charge.objects.create(label="c")
        return "ok"

    plain, keyed = same(work)
    assert plain == ("ok", ["a", "c"])
    assert keyed == plain, LAST.get("exc")


# -- refused release via the SAVEPOINT-create carrier, caught ----------------


def test_double_release_carried_by_savepoint_create_is_not_success() -> None:
    def work() -> str:
        Charge.objects.create(label="a")
        try:
            with transaction.atomic():
                sid = savepoint()
                Charge.objects.create(label="b")
                transaction.savepoint_commit(sid)
                try:
                    transaction.savepoint_commit(sid)
                except DatabaseError:
                    raise
                with transaction.atomic():
                    Charge.objects.create(label="x")
        except DatabaseError:
            pass
        Charge.objects.create(label="c")
        return "ok"

    plain, keyed = same(work)
    assert plain == ("ok", ["a", "c"])
    assert keyed == plain or keyed[0].startswith("raised"), keyed
    assert keyed[1] == plain[1] or keyed[0].startswith("raised")


# -- cached connection: close / close_all / reconnect mid-work ---------------


@pytest.mark.parametrize("how", ["close", "close_all", "close_if_unusable"])
def test_closing_connection_mid_work(how: str) -> None:
    def work() -> str:
        Charge.objects.create(label="a")
        if how == "close":
            connection.close()
        elif how == "close_all":
            connections.close_all()
        else:
            connection.close_if_unusable_or_obsolete()
        Charge.objects.create(label="b")
        return "ok"

    plain, keyed = same(work)
    assert keyed[1] == plain[1] == [] or keyed == plain, (plain, keyed)
    assert not (isinstance(keyed[0], str) and keyed[0] == "ok" and keyed[1] != ["a", "b"])


@pytest.mark.parametrize("how", ["close", "close_all"])
def test_closing_connection_mid_work_inside_block_caught(how: str) -> None:
    def work() -> str:
        Charge.objects.create(label="a")
        try:
            with transaction.atomic():
                with transaction.atomic():
                    Charge.objects.create(label="b")
                if how == "close":
                    connection.close()
                else:
                    connections.close_all()
                Charge.objects.create(label="c")
        except Exception as exc:
            seen.append(type(exc).__name__)
        try:
            Charge.objects.create(label="d")
        except Exception as exc:
            seen.append(type(exc).__name__)
        return "ok"

    seen: list[str] = []
    plain, keyed = same(work)
    print(plain, keyed, seen, LAST.get("exc"))
    # never a stored success whose writes are not committed
    if keyed[0] == "ok":
        rec = LAST["rec"]
        assert rec is None or rec.status != "completed" or keyed[1], (keyed, rec.status)
    assert not (keyed[0] == "ok" and plain[0] != "ok"), (plain, keyed)
