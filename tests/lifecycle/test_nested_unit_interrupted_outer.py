"""A refund (inner ``service.once``) inside a charge (outer ``service.once``).
The refund's work ends the shared transaction through the driver, so the
charge's ledger row, written before the refund, committed. The refund's key is
kept interrupted; the charge's key must be too: a retry of the charge must
never run its (committed) ledger write again."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.server_db]

SCOPE = "tests:nested-interrupt-outer"


def test_outer_unit_is_not_released_when_nested_unit_ended_the_transaction() -> None:
    outer_key, inner_key = str(uuid.uuid4()), str(uuid.uuid4())
    with pytest.raises(service.OutcomeUnknown), service.once(SCOPE, outer_key, "charge") as outer:
        assert outer.should_execute
        Charge.objects.create(label="ledger-charge", amount=100)
        with service.once(SCOPE, inner_key, "refund") as inner:
            assert inner.should_execute
            Charge.objects.create(label="ledger-refund", amount=-100)
            connection.connection.commit()
            inner.result = "refunded"
        outer.result = "charged"
    assert Charge.objects.filter(label="ledger-charge").count() == 1  # committed by the raw commit
    found = service.lookup(SCOPE, outer_key)
    assert found is not None and found.interrupted, found
    ran = False
    with pytest.raises(service.OutcomeUnknown), service.once(SCOPE, outer_key, "charge") as again:
        ran = again.should_execute
        if ran:
            Charge.objects.create(label="ledger-charge", amount=100)
            again.result = "charged"
    assert not ran
    assert Charge.objects.filter(label="ledger-charge").count() == 1
