from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import IntegrityError, transaction

from idempotency_app import clock
from idempotency_app.models import IdempotencyRecord


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    out = StringIO()
    try:
        call_command("makemigrations", "idempotency_app", "--check", "--dry-run", stdout=out)
    except SystemExit:
        pytest.fail(f"idempotency_app has model changes without a migration:\n{out.getvalue()}")


@pytest.mark.django_db
def test_scope_and_key_are_unique() -> None:
    now = clock.now()
    fields = dict(
        operation="POST x",
        fingerprint="f",
        status="completed",
        token="t",
        created_at=now,
        expires_at=now,
    )
    IdempotencyRecord.objects.create(scope="user:1", key="k", **fields)
    IdempotencyRecord.objects.create(scope="user:2", key="k", **fields)
    with pytest.raises(IntegrityError), transaction.atomic():
        IdempotencyRecord.objects.create(scope="user:1", key="k", **fields)
