"""The claim past the cursor binds its text arguments by their value, as
psycopg's cursor binds a str subclass: a ``(str, Enum)`` member (a common
way to name operations and scopes) has a ``str()`` that is not its value."""

from __future__ import annotations

import enum
import uuid

import pytest
from django.db import transaction

from idempotency_app import service
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


class Op(str, enum.Enum):
    PAYOUT = "payout"


class Scope(str, enum.Enum):
    ACME = "provider:acme"


def run_once(scope: str, key: str, operation: str, label: str) -> object:
    with service.once(scope, key, operation) as run:
        if run.should_execute:
            Charge.objects.create(label=label)
            run.result = {"label": label}
    return run


def test_an_enum_operation_is_stored_by_its_value() -> None:
    """The record's operation is what the caller's string holds."""
    key = str(uuid.uuid4())
    run_once("tests:by-value", key, Op.PAYOUT, "a")
    assert list(IdempotencyRecord.objects.filter(key=key).values_list("operation", flat=True)) == [
        "payout"
    ]


def test_an_enum_operation_replays_rather_than_reused() -> None:
    """The retry with the same operation replays the stored result."""
    key = str(uuid.uuid4())
    run_once("tests:by-value", key, Op.PAYOUT, "a")
    again = run_once("tests:by-value", key, Op.PAYOUT, "b")
    assert not again.should_execute and again.result == {"label": "a"}
    assert labels() == ["a"]


def test_an_enum_scope_retry_inside_atomic_does_not_run_twice() -> None:
    """First call in autocommit (past the cursor); the retry inside the
    caller's transaction.atomic() (nothing sent yet: through the cursor)
    must find the record and replay, not charge again."""
    key = str(uuid.uuid4())
    run_once(Scope.ACME, key, "payout", "a")
    with transaction.atomic():
        again = run_once(Scope.ACME, key, "payout", "b")
    assert not again.should_execute
    assert labels() == ["a"]
