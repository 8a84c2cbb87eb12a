"""Make ``scope`` and ``key`` compare byte for byte on MySQL and MariaDB.

Their default collations ignore case and accents and pad trailing spaces, so
"evt_AbC", "evt_aBc" and "evt_abc " could share one record: one request
answered with another's stored response. A binary NO PAD collation compares
exactly (MariaDB: utf8mb4_nopad_bin; MySQL 8: utf8mb4_0900_bin; older MySQL
has only the padding utf8mb4_bin). Other databases compare exactly already.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def _exact_collation(connection: Any) -> str:
    if connection.mysql_is_mariadb:
        return "utf8mb4_nopad_bin"
    return "utf8mb4_0900_bin" if connection.mysql_version >= (8,) else "utf8mb4_bin"


def _modify(exact: bool) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        if connection.vendor != "mysql":
            return
        collation = _exact_collation(connection) if exact else "utf8mb4_general_ci"
        q = schema_editor.quote_name
        table = q(apps.get_model("idempotency_app", "IdempotencyRecord")._meta.db_table)
        for column in ("scope", "key"):
            schema_editor.execute(
                f"ALTER TABLE {table} MODIFY {q(column)} varchar(255) "
                f"CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
            )

    return run


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction
    dependencies = [("idempotency_app", "0001_initial")]

    operations = [
        migrations.RunPython(_modify(exact=True), _modify(exact=False), elidable=False),
    ]
