"""The statement guard on the driver's cursor let a statement through
without asking which session it is on when it is the very object the
work's execute wrapper is judging (``state.judging``) in the work's
thread. An execute wrapper of the work's own runs inside the library's
guard, while ``state.judging`` is set: one that sends the statement it
wraps to a second connection to the same database (a connection opened
by hand: a shadow/mirror write, an audit copy) had that write committed
at once, outside the work's transaction, unrefused. The work then failed
and was released, its own write rolled back, but the mirrored row stayed;
the retry wrote it again.

The guarantee: refused as any write through another connection is
(``CannotBeAtomic``, "another connection"), nothing committed."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connections

from idempotency_app import service
from idempotency_app.exceptions import CannotBeAtomic
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]

SCOPE = "tests:other-connections"


def test_a_write_mirrored_to_a_second_connection_by_the_works_wrapper_is_refused() -> None:
    key = str(uuid.uuid4())
    own = connections["default"]
    side = connections.create_connection("default")

    def mirror(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        if isinstance(sql, str) and sql.startswith("INSERT") and "testapp_charge" in sql:
            with side.cursor() as cursor:
                cursor.execute(sql, params)  # the same statement, on the shadow connection
        return execute(sql, params, many, context)

    try:
        with pytest.raises(CannotBeAtomic), service.once(SCOPE, key, "op") as run:
            if run.should_execute:
                with own.execute_wrapper(mirror):
                    Charge.objects.create(label="work")
                run.result = "done"
    finally:
        side.close()
    # Nothing committed outside the work: a retry would write it again.
    assert list(Charge.objects.values_list("label", flat=True)) == []
