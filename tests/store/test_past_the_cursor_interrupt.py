"""A claim waiting on a lock, interrupted (Ctrl-C, or SystemExit from a
worker's signal handler: gunicorn's SIGABRT on a worker timeout, SIGQUIT):
psycopg's cursor waits in Python and cancels the query on KeyboardInterrupt
and SystemExit. The claim past the cursor waits the same way, where a
blocking libpq call would run no signal handler until the server answered,
and commit the claim for a worker that is gone."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import backend
from idempotency_app.store.base import Identity

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]
SCOPE = "tests:past-the-cursor-interrupt"


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _interrupted_behind_a_lock(through_cursor: bool, held_for: float) -> Iterator[list[float]]:
    """The body runs while another session holds the records table locked
    (for ``held_for`` seconds), through the cursor or past it, and is
    interrupted by KeyboardInterrupt after half a second; it yields where
    the seconds the body took until the interrupt reached it are put."""
    import psycopg

    connection.ensure_connection()
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    locker = psycopg.connect(**params)
    table = IdempotencyRecord._meta.db_table
    locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")  # in a transaction
    timer = threading.Timer(held_for, locker.rollback)
    timer.start()
    wrap = (
        connection.execute_wrapper(lambda execute, *args: execute(*args))
        if through_cursor
        else contextlib.nullcontext()
    )
    previous = signal.signal(signal.SIGALRM, _interrupt)
    took: list[float] = []
    start = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt), wrap:
            yield took
        took.append(time.monotonic() - start)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        timer.join()
        locker.close()


@pytest.mark.parametrize("through_cursor", [True, False], ids=["cursor", "past"])
def test_an_interrupted_claim_waiting_on_a_lock_claims_nothing(through_cursor: bool) -> None:
    identity = Identity(SCOPE, str(uuid.uuid4()), "op", "f")
    store = backend("default")
    with _interrupted_behind_a_lock(through_cursor, held_for=3.0) as took:
        store.claim(identity, "token", 60, 30)
    claimed = IdempotencyRecord.objects.filter(key=identity.key).exists()
    connection.close()
    # Interrupted while waiting: the claim was cancelled, not committed
    # behind the caller's back for a worker that is gone.
    assert (took[0] < 2.0, claimed) == (True, False)


@pytest.mark.parametrize("through_cursor", [True, False], ids=["cursor", "past"])
def test_a_retry_after_an_interrupted_claim_runs(through_cursor: bool) -> None:
    """Through ``service.once``: the interrupted request leaves no claim
    behind, so its retry runs rather than get KeyInProgress (a 409) until
    the lease lapses."""
    from idempotency_app import service
    from idempotency_app.exceptions import KeyInProgress

    key = str(uuid.uuid4())
    with (
        _interrupted_behind_a_lock(through_cursor, held_for=2.0),
        service.once(SCOPE, key, "op", wait=0) as run,
    ):
        if run.should_execute:
            run.result = "first"
    try:
        with service.once(SCOPE, key, "op", wait=0) as run:
            if run.should_execute:
                run.result = "retry"
        outcome = run.result
    except KeyInProgress:
        outcome = "409"
    connection.close()
    assert outcome == "retry"
