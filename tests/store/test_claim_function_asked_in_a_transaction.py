"""A process asks once, at its first claim, whether the claim function can
be called. When that first claim is made inside the caller's transaction
(``ATOMIC_REQUESTS``, or the caller's own ``atomic()``), the question runs
in that transaction: if it fails, the caller's transaction must go on as
if it had never been asked, and the claim falls back to its statement."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from idempotency_app import service
from idempotency_app.store import backend, postgresql
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]

SCOPE = "tests:claim-function-asked-in-a-transaction"
# Searched before pg_catalog, its has_function_privilege is the one the
# question calls, and it fails.
SCHEMA = "idempotency_tests_refusing"


@pytest.fixture
def question_fails() -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        cursor.execute(
            f"CREATE OR REPLACE FUNCTION {SCHEMA}.has_function_privilege(oid, text) "
            "RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$"
        )
    records = backend("default")
    asked = records.claims_by_function
    records.claims_by_function = None  # the process's first claim
    try:
        yield
    finally:
        records.claims_by_function = asked
        connection.close()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def test_a_failed_question_leaves_the_callers_transaction_as_it_was(question_fails: None) -> None:
    with transaction.atomic():
        Charge.objects.create(label="before")
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL search_path = {SCHEMA}, pg_catalog, public")
        with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
            if run.should_execute:
                Charge.objects.create(label="work")
                run.result = "done"
        Charge.objects.create(label="after")
    assert run.result == "done"
    assert sorted(Charge.objects.values_list("label", flat=True)) == ["after", "before", "work"]
    assert backend("default").claims_by_function is None  # asked again at a later claim


def test_the_question_asked_in_a_transaction_answers_and_leaves_no_savepoint() -> None:
    records = backend("default")
    asked, records.claims_by_function = records.claims_by_function, None
    try:
        with transaction.atomic():
            Charge.objects.create(label="before")
            with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
                if run.should_execute:
                    run.result = "done"
            assert records.claims_by_function is True
            with (
                connection.cursor() as cursor,
                pytest.raises(Exception, match="does not exist"),
                transaction.atomic(),
            ):
                cursor.execute(f"RELEASE SAVEPOINT {postgresql.ASKING}")
    finally:
        records.claims_by_function = asked
    assert list(Charge.objects.values_list("label", flat=True)) == ["before"]
