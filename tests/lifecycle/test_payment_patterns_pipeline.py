"""``service.once`` inside a caller's psycopg pipeline and transaction:
each key's result is its own, and each work runs once."""

from __future__ import annotations

import uuid

import pytest
from django.db import connections, transaction

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def test_once_inside_psycopg_pipeline_two_keys():
    conn = connections["default"]
    conn.ensure_connection()
    raw = conn.connection
    if not hasattr(raw, "pipeline"):
        pytest.skip("psycopg3 only")
    scope = "pipe:" + uuid.uuid4().hex
    outs = {}
    with raw.pipeline():
        for k, size in [("a", 70_000), ("b", 2), ("c", 0)]:
            with transaction.atomic(), service.once(scope, k, "op") as run:
                if run.should_execute:
                    Charge.objects.create(label=k)
                    run.result = {"k": k, "d": "x" * size}
            outs[k] = run.result
        for _ in range(2):
            for k, expected in outs.items():
                with service.once(scope, k, "op") as run:
                    assert not run.should_execute, k
                assert run.result == expected
    assert sorted(Charge.objects.values_list("label", flat=True)) == ["a", "b", "c"]
