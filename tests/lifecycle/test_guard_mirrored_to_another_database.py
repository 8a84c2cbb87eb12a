"""An execute wrapper installed in the view (a shadow-ledger helper) copies
each ledger INSERT it sees to the audit database, through that database's
driver cursor, passing on the very ``sql`` object it was handed. A write on
another database must be refused (docs/guarantees.md, "What is refused":
every statement the work sends is judged, through Django's cursor and the
driver's own): the work fails with CannotBeAtomic and nothing commits on
the other side, so a released-and-retried charge never leaves two shadow
rows behind.

The driver-cursor guard let the statement through unjudged, because it was
the object Django's wrapper on the *work's* connection was judging (``sql
is state.judging``): the shadow row committed at once (autocommit), the
work was released (provider error), and the retry wrote a second one."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, connections

from idempotency_app import service
from idempotency_app.exceptions import CannotBeAtomic
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.server_db,
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
]

CHARGE = Charge._meta.db_table


def shadow(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
    result = execute(sql, params, many, context)
    if isinstance(sql, str) and sql.lstrip().upper().startswith("INSERT") and CHARGE in sql:
        other = connections["other"]
        other.ensure_connection()
        raw = other.connection.cursor()
        try:
            raw.execute(sql, params)  # the same statement object, to the shadow ledger
        finally:
            raw.close()
    return result


class ProviderDown(Exception):
    pass


def attempt(fail: bool) -> None:
    with service.once("tests:mirror-to-another-database", "k1", "charge") as run:
        assert run.should_execute
        with connection.execute_wrapper(shadow):
            Charge.objects.create(label="debit", amount=-100)
        if fail:
            raise ProviderDown
        run.result = "ok"


def test_mirrored_write_to_other_database_is_refused() -> None:
    with pytest.raises(CannotBeAtomic):
        attempt(fail=False)
    assert Charge.objects.filter(label="debit").count() == 0
    assert Charge.objects.using("other").filter(label="debit").count() == 0


def test_released_work_leaves_no_shadow_write_behind() -> None:
    for _ in range(2):  # the provider fails, the key is released, the client retries
        with pytest.raises((ProviderDown, CannotBeAtomic)):
            attempt(fail=True)
    assert Charge.objects.filter(label="debit").count() == 0
    assert Charge.objects.using("other").filter(label="debit").count() == 0
