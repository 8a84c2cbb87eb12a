"""A B-tree on (created_at, id) for a day picked in the admin's date drill-down.

The drill-down lists the day's records newest first (``created_at DESC, id
DESC``); this index hands over a page in that order, so a page reads its own
rows and no others. 0004's ``idempotency_created_idx`` could not: on
PostgreSQL it was a BRIN index, which finds the day's pages but in no order,
so the planner either read and sorted every row of the day or walked the
primary key backward past the newer days (about 590,000 rows for a page of
100 at a million rows, docs/operations.md). On MySQL and SQLite it was a B-tree on created_at
alone, which the new index covers, so it goes everywhere.

Built as 0004's indexes were, without blocking writes (CREATE INDEX
CONCURRENTLY, so not atomic; MySQL's online DDL), the new index before the
old one is dropped, and runnable again after an interruption: an index
already built is kept, an invalid one left by a concurrent build cut short is
dropped and built again.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

NEW = "idempotency_created_id_idx"
OLD = "idempotency_created_idx"


def _table(apps: Any, schema_editor: Any) -> tuple[str, set[str]]:
    """The quoted records table and the names of its indexes."""
    connection = schema_editor.connection
    name = apps.get_model("idempotency_app", "IdempotencyRecord")._meta.db_table
    with connection.cursor() as cursor:
        existing = set(connection.introspection.get_constraints(cursor, name))
        if connection.vendor == "postgresql":  # a concurrent build cut short
            cursor.execute(
                "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE NOT i.indisvalid AND i.indrelid = to_regclass(%s)",
                [connection.ops.quote_name(name)],
            )
            for (invalid,) in cursor.fetchall():
                if invalid in (NEW, OLD):
                    schema_editor.execute(
                        f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(invalid)}"
                    )
                    existing.discard(invalid)
    return schema_editor.quote_name(name), existing


def _build(schema_editor: Any, table: str, name: str, columns: str, brin: bool = False) -> None:
    q = schema_editor.quote_name
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        using = " USING brin" if brin else ""
        schema_editor.execute(f"CREATE INDEX CONCURRENTLY {q(name)} ON {table}{using} ({columns})")
    elif vendor == "mysql":
        schema_editor.execute(
            f"ALTER TABLE {table} ADD INDEX {q(name)} ({columns}), ALGORITHM=INPLACE, LOCK=NONE"
        )
    else:
        schema_editor.execute(f"CREATE INDEX {q(name)} ON {table} ({columns})")


def _remove(schema_editor: Any, table: str, name: str) -> None:
    q = schema_editor.quote_name
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {q(name)}")
    elif vendor == "mysql":
        schema_editor.execute(f"ALTER TABLE {table} DROP INDEX {q(name)}")
    else:
        schema_editor.execute(f"DROP INDEX IF EXISTS {q(name)}")


def _forwards(apps: Any, schema_editor: Any) -> None:
    q = schema_editor.quote_name
    table, existing = _table(apps, schema_editor)
    if NEW not in existing:
        _build(schema_editor, table, NEW, f"{q('created_at')}, {q('id')}")
    if OLD in existing:
        _remove(schema_editor, table, OLD)


def _backwards(apps: Any, schema_editor: Any) -> None:
    """0004's index again: BRIN on PostgreSQL, a B-tree on created_at elsewhere."""
    table, existing = _table(apps, schema_editor)
    if OLD not in existing:
        brin = schema_editor.connection.vendor == "postgresql"
        _build(schema_editor, table, OLD, schema_editor.quote_name("created_at"), brin=brin)
    if NEW in existing:
        _remove(schema_editor, table, NEW)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("idempotency_app", "0005_interrupted_status")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="idempotencyrecord",
                    index=models.Index(fields=["created_at", "id"], name=NEW),
                )
            ],
            database_operations=[migrations.RunPython(_forwards, _backwards, elidable=False)],
        )
    ]
