"""Migration 0004 builds its indexes on a live table, outside a transaction:
a run cut short must be able to run again and leave every index usable."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from django.apps import apps
from django.db import connection

from idempotency_app.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True)

indexes = importlib.import_module("idempotency_app.migrations.0004_indexes_for_large_tables")
NAMES = {indexes.SCOPE_INDEX, indexes.LEASE_INDEX, indexes.CREATED_INDEX}


def present() -> set[str]:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, IdempotencyRecord._meta.db_table)
    return NAMES & set(found)


def invalid() -> set[str]:
    if connection.vendor != "postgresql":
        return set()
    return set(indexes._invalid_indexes(connection, apps))


def run(step: Any) -> None:
    with connection.schema_editor(atomic=False) as editor:
        step(apps, editor)


def test_running_the_indexes_again_keeps_them() -> None:
    run(indexes._create)
    assert present() == NAMES and not invalid()


def test_a_build_cut_short_is_built_again() -> None:
    if connection.vendor == "postgresql":
        # What an interrupted CREATE INDEX CONCURRENTLY leaves behind.
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass",
                [indexes.LEASE_INDEX],
            )
        assert invalid() == {indexes.LEASE_INDEX}
    else:
        with connection.cursor() as cursor:
            cursor.execute(
                f"DROP INDEX {connection.ops.quote_name(indexes.LEASE_INDEX)}"
                + (
                    f" ON {IdempotencyRecord._meta.db_table}"
                    if connection.vendor == "mysql"
                    else ""
                )
            )
        assert present() == NAMES - {indexes.LEASE_INDEX}
    run(indexes._create)
    assert present() == NAMES and not invalid()


def test_reversing_twice_then_migrating_again() -> None:
    try:
        run(indexes._drop)
        assert present() == set()
        run(indexes._drop)
    finally:
        run(indexes._create)
    assert present() == NAMES and not invalid()
