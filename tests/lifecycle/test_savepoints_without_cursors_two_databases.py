"""Savepoints without cursors: blocks on a second alias interleaved with the
claim's database."""

from __future__ import annotations

import uuid

import pytest
from django.db import connections, transaction

from idempotency_app import service
from tests.conftest import charge_labels as labels
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True, databases="__all__"), pytest.mark.postgresql]


def test_blocks_on_other_alias_interleaved() -> None:
    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="a")
            with transaction.atomic(using="other"):
                n = Charge.objects.using("other").count()
                assert "_savepoint" not in vars(connections["other"])
                with transaction.atomic():
                    Charge.objects.create(label="b")
            with transaction.atomic(using="other"):
                Charge.objects.using("other").exists()
        return f"ok {n}"

    with service.once(
        "tests:savepoints-without-cursors", str(uuid.uuid4()), "tests.savepoints_without_cursors"
    ) as run:
        if run.should_execute:
            run.result = work()
    assert run.result == "ok 0"
    assert labels() == ["a", "b"]
    assert "_savepoint" not in vars(connections["default"])
    assert "_savepoint" not in vars(connections["other"])
