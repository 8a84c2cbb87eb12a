"""A unit nested in another unit's work (``service.once`` for key B called
inside the work of key A: nested mode, B's claim shares A's transaction).
B's work ends that transaction through the driver (a raw ``commit()``),
so B's claim committed, and B must be kept *interrupted* so that no
retry runs B's work again (docs/guarantees.md, "A transaction the work ends anyway"). ``Records.interrupt`` marked it through a connection of its own
(``connections.create_connection``), but by then the running work is
A's again (B's ``confined`` has reset the context variable): the
guard on the driver's cursor took that connection for "another
connection" of A's work and refused the UPDATE (``CannotBeAtomic``,
logged as "Could not mark ... interrupted"). B stayed in progress; once
its lease ended, a retry ran B's committed work a second time.
(``service.renew`` got ``work.by_the_library()`` for the same reason;
``interrupt`` had not.)

The guarantee: B's record is interrupted; a retry with B's key
raises ``OutcomeUnknown`` and does not run."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]

SCOPE = "tests:nested-interrupted"


def test_a_nested_unit_that_ends_the_transaction_is_kept_interrupted() -> None:
    outer_key, inner_key = str(uuid.uuid4()), str(uuid.uuid4())
    with pytest.raises(service.OutcomeUnknown), service.once(SCOPE, outer_key, "outer") as outer:
        assert outer.should_execute
        with service.once(SCOPE, inner_key, "inner") as inner:
            assert inner.should_execute
            Charge.objects.create(label="debit", amount=-100)
            connection.connection.commit()
            inner.result = "paid"
        outer.result = "done"
    assert Charge.objects.filter(label="debit").count() == 1  # committed by the raw commit
    found = service.lookup(SCOPE, inner_key)
    assert found is not None and found.interrupted, found
    with pytest.raises(service.OutcomeUnknown), service.once(SCOPE, inner_key, "inner"):
        pytest.fail("an interrupted key never runs its work again")
