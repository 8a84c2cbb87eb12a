"""Migrations 0004 and 0006 build their indexes on a live table, outside a
transaction: a run cut short must be able to run again and leave every index
usable, and the database must end with the indexes the model declares."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from django.apps import apps
from django.db import connection

from idempotency_app.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True)

indexes = importlib.import_module("idempotency_app.migrations.0004_indexes_for_large_tables")
created = importlib.import_module("idempotency_app.migrations.0006_created_index_in_list_order")
NAMES = {indexes.SCOPE_INDEX, indexes.LEASE_INDEX, indexes.CREATED_INDEX}


def constraints() -> dict[str, Any]:
    with connection.cursor() as cursor:
        return connection.introspection.get_constraints(cursor, IdempotencyRecord._meta.db_table)


def present() -> set[str]:
    return NAMES & set(constraints())


@pytest.fixture(autouse=True)
def migrated() -> Any:
    """Every test ends where ``migrate`` leaves the table: 0004's steps run
    here bring back the creation-time index that 0006 replaces."""
    yield
    run(created._forwards)


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
        assert indexes.LEASE_INDEX not in present()
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


def test_the_models_indexes_are_the_databases() -> None:
    """0006 declares its index to the migration state and builds it apart:
    the two must agree (makemigrations --check is in test_models.py)."""
    found = constraints()
    for index in IdempotencyRecord._meta.indexes:
        assert found[index.name]["index"] and found[index.name]["columns"] == index.fields
    assert created.OLD not in found


def test_0006_run_again_or_cut_short_ends_with_the_new_index_only() -> None:
    run(created._forwards)
    assert created.NEW in constraints() and created.OLD not in constraints()
    if connection.vendor == "postgresql":
        # What an interrupted CREATE INDEX CONCURRENTLY leaves behind.
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE pg_index SET indisvalid = false WHERE indexrelid = %s::regclass",
                [created.NEW],
            )
        assert invalid_names() == {created.NEW}
    else:
        run(created._backwards)  # the old index back, the new one gone
    run(created._forwards)
    assert created.NEW in constraints() and created.OLD not in constraints()
    assert not invalid_names()


def test_0006_reversed_twice_then_migrated_again() -> None:
    run(created._backwards)
    run(created._backwards)
    found = constraints()
    assert created.OLD in found and created.NEW not in found
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_get_indexdef(%s::regclass)", [created.OLD])
            assert "USING brin" in cursor.fetchone()[0]
    run(created._forwards)
    assert created.NEW in constraints() and created.OLD not in constraints()


def invalid_names() -> set[str]:
    if connection.vendor != "postgresql":
        return set()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE NOT i.indisvalid AND i.indrelid = %s::regclass",
            [IdempotencyRecord._meta.db_table],
        )
        return {name for (name,) in cursor.fetchall()}
