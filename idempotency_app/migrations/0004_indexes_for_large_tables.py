"""Three indexes that keep operations cheap on a table of tens of millions:

- ``idempotency_scope_idx`` on (scope, id): the admin's search by scope, and
  its list of one scope's records newest first, read only that scope's rows.
  On PostgreSQL on the scope in the "C" collation (see the admin's search).
- ``idempotency_lease_idx`` on the lease of in-progress claims: the sweep's
  stale-claim pass reads only claims, not every live record. Partial where the
  database can (PostgreSQL, SQLite); on MySQL, (status, locked_until).
- ``idempotency_created_idx`` on created_at: a day picked in the admin's date
  drill-down. A BRIN index on PostgreSQL: rows arrive in created_at order, so
  a few pages summarise millions of rows and a write barely touches it.

Built without blocking writes on a live table: PostgreSQL's CREATE INDEX
CONCURRENTLY (so this migration is not atomic), MySQL's online DDL. An
interrupted run can simply be run again: an index already built is kept, an
invalid one (a concurrent build cut short) is dropped and built again. See
docs/operations.md, "Migrating a large live table".
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

SCOPE_INDEX = "idempotency_scope_idx"
LEASE_INDEX = "idempotency_lease_idx"
CREATED_INDEX = "idempotency_created_idx"


def _create(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    q = schema_editor.quote_name
    table = q(apps.get_model("idempotency_app", "IdempotencyRecord")._meta.db_table)
    vendor = connection.vendor
    if vendor == "postgresql":
        statements = [
            # In the "C" collation, which only the admin's search asks for:
            # the planner can then never read it for a claim's
            # scope = ... AND key = ... instead of the unique index.
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {q(SCOPE_INDEX)} ON {table} "
            f'(({q("scope")} COLLATE "C"), {q("id")})',
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {q(LEASE_INDEX)} ON {table} "
            f"({q('locked_until')}) WHERE {q('status')} = 'in_progress'",
            f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {q(CREATED_INDEX)} ON {table} "
            f"USING brin ({q('created_at')})",
        ]
    elif vendor == "mysql":
        online = "ALGORITHM=INPLACE, LOCK=NONE"
        statements = [
            f"ALTER TABLE {table} ADD INDEX {q(SCOPE_INDEX)} ({q('scope')}, {q('id')}), {online}",
            f"ALTER TABLE {table} ADD INDEX {q(LEASE_INDEX)} "
            f"({q('status')}, {q('locked_until')}), {online}",
            f"ALTER TABLE {table} ADD INDEX {q(CREATED_INDEX)} ({q('created_at')}), {online}",
        ]
    else:
        statements = [
            f"CREATE INDEX IF NOT EXISTS {q(SCOPE_INDEX)} ON {table} ({q('scope')}, {q('id')})",
            f"CREATE INDEX IF NOT EXISTS {q(LEASE_INDEX)} ON {table} "
            f"({q('locked_until')}) WHERE {q('status')} = 'in_progress'",
            f"CREATE INDEX IF NOT EXISTS {q(CREATED_INDEX)} ON {table} ({q('created_at')})",
        ]
    if vendor == "postgresql":
        for name in _invalid_indexes(connection, apps):
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {q(name)}")
    existing = _existing_indexes(connection, apps)
    for name, statement in zip((SCOPE_INDEX, LEASE_INDEX, CREATED_INDEX), statements, strict=True):
        if name not in existing:
            schema_editor.execute(statement)


def _existing_indexes(connection: Any, apps: Any) -> set[str]:
    table = apps.get_model("idempotency_app", "IdempotencyRecord")._meta.db_table
    with connection.cursor() as cursor:
        return set(connection.introspection.get_constraints(cursor, table))


def _invalid_indexes(connection: Any, apps: Any) -> list[str]:
    """This migration's indexes on the records table left invalid by a
    CREATE INDEX CONCURRENTLY that was cut short: IF NOT EXISTS would keep
    them, unusable."""
    table = apps.get_model("idempotency_app", "IdempotencyRecord")._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE NOT i.indisvalid AND c.relname = ANY(%s) AND i.indrelid = to_regclass(%s)",
            [[SCOPE_INDEX, LEASE_INDEX, CREATED_INDEX], connection.ops.quote_name(table)],
        )
        return [name for (name,) in cursor.fetchall()]


def _drop(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    q = schema_editor.quote_name
    table = q(apps.get_model("idempotency_app", "IdempotencyRecord")._meta.db_table)
    existing = _existing_indexes(connection, apps)
    for name in (SCOPE_INDEX, LEASE_INDEX, CREATED_INDEX):
        if name not in existing:
            continue
        if connection.vendor == "mysql":
            schema_editor.execute(f"ALTER TABLE {table} DROP INDEX {q(name)}")
        elif connection.vendor == "postgresql":
            schema_editor.execute(f"DROP INDEX CONCURRENTLY {q(name)}")
        else:
            schema_editor.execute(f"DROP INDEX {q(name)}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction
    dependencies = [("idempotency_app", "0003_released_status")]

    operations = [
        migrations.SeparateDatabaseAndState(
            # The scope index is the model's; the lease index, partial on
            # most databases, is this migration's alone (Django cannot
            # declare a partial index on MySQL without a warning).
            state_operations=[
                migrations.AddIndex(
                    model_name="idempotencyrecord",
                    index=models.Index(fields=["scope", "id"], name=SCOPE_INDEX),
                )
            ],
            database_operations=[migrations.RunPython(_create, _drop, elidable=False)],
        )
    ]
