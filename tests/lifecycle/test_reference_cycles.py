"""A keyed request leaves nothing of the library to the garbage collector.

CPython frees an object as soon as its last reference goes, unless the
object is part of a reference cycle: then it waits for the cycle collector,
with everything it refers to. The statement guard once named itself in its
own closure, so every unit of work left a cycle holding the work's whole
state (the identity, the savepoints, the transaction probe) behind it: more
passes of the collector per request, and more for its full passes to read.
Each test runs a path twice (the first warms every cache), then names the
library's objects on a cycle among what only the collector could free.
"""

from __future__ import annotations

import contextlib
import gc
import types
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from typing import Any

import pytest
from django.db import connection, transaction
from rest_framework.test import APIClient

from idempotency_app import service, signals
from idempotency_app.exceptions import CannotBeAtomic, ClaimLost, OutcomeUnknown, WorkRolledBack
from idempotency_app.models import IdempotencyRecord
from tests.conftest import new_key, once_in, post
from tests.testapp.models import Charge, Tag

pytestmark = pytest.mark.django_db(transaction=True)

SCOPE, OP = "tests:reference-cycles", "tests.reference_cycles"
once = once_in(SCOPE, OP)


def _of_the_library(thing: Any) -> bool:
    module = (
        thing.__module__
        if isinstance(thing, types.FunctionType | types.MethodType)
        else type(thing).__module__
    )
    return isinstance(module, str) and module.startswith("idempotency_app")


def _describe(thing: Any) -> str:
    return getattr(thing, "__qualname__", None) or type(thing).__qualname__


def _on_a_cycle(thing: Any, garbage: dict[int, Any]) -> bool:
    """Whether ``thing`` leads back to itself through ``garbage`` (by id):
    a cycle of its own, not one of someone else's that merely holds it (an
    exception caught in a view holds the frames it passed through). Not
    through ``contextlib``'s frames: from Python 3.13 its ``__exit__``
    keeps the exception it was given in a local while the generator raises
    another from it, a cycle of the standard library's."""
    seen: set[int] = set()
    todo = [found for found in gc.get_referents(thing) if id(found) in garbage]
    while todo:
        found = todo.pop()
        if found is thing:
            return True
        if id(found) not in seen and not _of_contextlib(found):
            seen.add(id(found))
            todo.extend(more for more in gc.get_referents(found) if id(more) in garbage)
    return False


def _of_contextlib(thing: Any) -> bool:
    return isinstance(thing, types.FrameType) and thing.f_code.co_filename == contextlib.__file__


@pytest.fixture
def left_to_the_collector() -> Iterator[Callable[[Callable[[], Any]], list[str]]]:
    """Run a call and name the library's objects on a reference cycle
    among what only the cycle collector could free afterwards."""
    enabled = gc.isenabled()

    def left(call: Callable[[], Any]) -> list[str]:
        call()
        gc.collect()
        gc.disable()  # no pass in the middle of the call
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a pass finds is kept in gc.garbage
        try:
            call()
            gc.collect()
            garbage = {id(thing): thing for thing in gc.garbage}
            return sorted(
                _describe(thing)
                for thing in gc.garbage
                if _of_the_library(thing) and _on_a_cycle(thing, garbage)
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    yield left
    if enabled:
        gc.enable()


def test_a_fresh_request_and_its_replay(
    api: APIClient, left_to_the_collector: Callable[..., list[str]]
) -> None:
    keys = iter([new_key() for _ in range(2)])

    def fresh() -> None:
        assert post(api, "/charges/", {"amount": 5}, next(keys)).status_code == 201

    assert left_to_the_collector(fresh) == []
    replayed = new_key()

    def replay() -> None:
        response = post(api, "/charges/", {"amount": 5}, replayed)
        assert response.status_code == 201

    assert left_to_the_collector(replay) == []
    assert Charge.objects.count() == 3


@pytest.mark.parametrize("tag", ["new", "taken"])
def test_a_view_writing_in_its_own_block(
    api: APIClient, left_to_the_collector: Callable[..., list[str]], tag: str
) -> None:
    """The view's block becomes a savepoint of the unit, released or (its
    INSERT refused and caught) rolled back to: the savepoint handling the
    guard puts on the connection is taken down again."""
    Tag.objects.create(name="taken")

    def fresh() -> None:
        name = tag if tag == "taken" else new_key()
        response = post(api, "/patterns/tag-if-new-atomic/", {"tag": name}, new_key())
        assert response.status_code == 201

    assert left_to_the_collector(fresh) == []


def test_a_mixin_view(api: APIClient, left_to_the_collector: Callable[..., list[str]]) -> None:
    def fresh() -> None:
        response = post(api, "/mixin-charges/", {"amount": 5}, new_key())
        assert response.status_code == 201

    assert left_to_the_collector(fresh) == []


def test_a_task_run_once(left_to_the_collector: Callable[..., list[str]]) -> None:
    def task() -> None:
        ran, _ = once(new_key(), lambda: Charge.objects.create(label="task").pk)
        assert ran

    assert left_to_the_collector(task) == []


@pytest.mark.skipif(find_spec("adrf") is None, reason="needs adrf: pip install -e '.[test]'")
def test_an_async_view(api: APIClient, left_to_the_collector: Callable[..., list[str]]) -> None:
    def fresh() -> None:
        response = post(api, "/async/charges/", {"amount": 5}, new_key())
        assert response.status_code == 201

    assert left_to_the_collector(fresh) == []


def test_refusals_and_errors(
    api: APIClient, quiet_api: APIClient, left_to_the_collector: Callable[..., list[str]]
) -> None:
    """A key in progress elsewhere (409), one sent again with another body
    (422), a validation error (400, released, its answer kept for a retry
    storm) and a crash inside the work (500, rolled back and released)."""
    used, held = new_key(), new_key()
    for key in (used, held):
        assert post(api, "/charges/", {"amount": 5}, key).status_code == 201
    IdempotencyRecord.objects.filter(key=held).update(
        status="in_progress", response_body=None, token="another-worker"
    )

    def in_progress() -> None:
        assert post(api, "/charges/", {"amount": 5}, held).status_code == 409

    def mismatch() -> None:
        assert post(api, "/charges/", {"amount": 6}, used).status_code == 422

    def invalid() -> None:
        response = post(api, "/charges/", {"raise": "validation"}, new_key())
        assert response.status_code == 400

    def crash() -> None:
        response = post(quiet_api, "/charges/", {"raise": "crash"}, new_key())
        assert response.status_code == 500

    def heard(**kwargs: Any) -> None:
        """Listening: the claim is timed (its refusal sent) only then."""

    signals.claim_timed.connect(heard, weak=False)
    try:
        for call in (in_progress, mismatch, invalid, crash):
            assert left_to_the_collector(call) == [], call.__name__
    finally:
        signals.claim_timed.disconnect(heard)


def test_a_task_inside_a_callers_transaction(
    left_to_the_collector: Callable[..., list[str]],
) -> None:
    def nested() -> None:
        with transaction.atomic():
            ran, _ = once(new_key(), lambda: Charge.objects.create(label="nested").pk)
            assert ran

    assert left_to_the_collector(nested) == []


# -- Work that comes to nothing: its exception is not kept where its traceback leads back


def test_a_view_that_marks_its_transaction_for_rollback(
    quiet_api: APIClient, left_to_the_collector: Callable[..., list[str]]
) -> None:
    """500 request_rolled_back: the unit kept the WorkRolledBack it raised."""

    def rolled_back() -> None:
        response = post(quiet_api, "/patterns/rolls-back-on-purpose/", {"amount": 5}, new_key())
        assert response.status_code == 500

    assert left_to_the_collector(rolled_back) == []


def test_tasks_that_come_to_nothing(left_to_the_collector: Callable[..., list[str]]) -> None:
    """A task whose transaction is marked for rollback (WorkRolledBack), one
    whose claim is taken over under it (ClaimLost, or WorkRolledBack where
    the completion rides with the COMMIT), one refused for sending COMMIT
    (CannotBeAtomic, which the work's state kept) and one whose transaction
    the driver ended (TransactionEnded, kept too; the caller gets
    OutcomeUnknown)."""

    def marked() -> None:
        with pytest.raises(WorkRolledBack), service.once(SCOPE, new_key(), OP) as run:
            Charge.objects.create(label="marked")
            transaction.set_rollback(True)
            run.result = 1

    def taken_over() -> None:
        key = new_key()
        with pytest.raises((ClaimLost, WorkRolledBack)), service.once(SCOPE, key, OP) as run:
            Charge.objects.create(label="taken over")
            IdempotencyRecord.objects.filter(key=key).update(token="another-worker")
            run.result = 1

    def refused() -> None:
        with pytest.raises(CannotBeAtomic), service.once(SCOPE, new_key(), OP):
            Charge.objects.create(label="refused")
            with connection.cursor() as cursor:
                cursor.execute("COMMIT")

    def ended() -> None:
        with pytest.raises(OutcomeUnknown), service.once(SCOPE, new_key(), OP):
            Charge.objects.create(label="ended")
            connection.connection.commit()  # the driver's own: no wrapper sees it
            Charge.objects.create(label="after")

    for call in (marked, taken_over, refused, ended):
        assert left_to_the_collector(call) == [], call.__name__
