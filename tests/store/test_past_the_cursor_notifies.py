"""psycopg hands each notification that arrives with a statement's reply to
the connection's notify handlers (``add_notify_handler``) as it reads the
reply. The claim and the completion sent past the cursor read their replies
the same way: a notification that arrives with the COMMIT reaches the
handlers, rather than wait in libpq's queue until the connection closes
at the request's end (CONN_MAX_AGE 0)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:past-the-cursor-notifies"


@pytest.mark.parametrize("through_cursor", [True, False], ids=["cursor", "past"])
def test_a_notification_arriving_with_the_commit_reaches_the_handler(through_cursor: bool) -> None:
    import psycopg

    connection.ensure_connection()
    raw = connection.connection
    received: list[str] = []
    raw.add_notify_handler(lambda notify: received.append(notify.payload))
    with connection.cursor() as cursor:
        cursor.execute("LISTEN past_the_cursor_channel")
    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    notifier = psycopg.connect(**params, autocommit=True)
    wrapped: Any = (
        connection.execute_wrapper(lambda execute, *args: execute(*args))
        if through_cursor
        else None
    )
    try:
        if wrapped is not None:
            wrapped.__enter__()
        with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
            if run.should_execute:
                Charge.objects.create(label="a")
                # Delivered to this session once its transaction ends.
                notifier.execute("NOTIFY past_the_cursor_channel, 'paid'")
                run.result = "done"
        if wrapped is not None:
            wrapped.__exit__(None, None, None)
        handled = list(received)
    finally:
        notifier.close()
        connection.close()  # the request's end
    assert handled == ["paid"]
