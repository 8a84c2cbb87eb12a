"""PostgreSQL: the claim as a PL/pgSQL function, so the server plans it once
per connection rather than once per claim.

The claim is one statement (an INSERT that the unique constraint arbitrates,
and the read of the record it met). Sent as text, the server parses and
plans it on every request: about 0.2 ms of its time, more than it takes to
run. A PL/pgSQL function keeps the plans of its statements for the life of
the server's session, which also holds behind a transaction-mode pooler,
where the driver's own prepared statements could meet another client's.

The body is the claim statement of ``idempotency_app.store.postgresql``
with its parameters as the function's arguments; a test keeps the two the
same, and a change to the statement comes with a new function
(``idempotency_claim_v2``) in a new migration. Until this migration has run
the store sends the statement itself, as before. Other databases: nothing.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

NAME = "idempotency_claim_v1"
ARGUMENTS = (
    "_scope text, _key text, _operation text, _fingerprint text, _token text, "
    "_now float8, _expires float8, _lease float8, _soon float8, _alone boolean"
)
# The record's columns a claim that meets one reads (o_: the table's own
# column names would be ambiguous inside the body).
RESULT = (
    "o_token varchar, o_operation varchar, o_fingerprint varchar, o_status varchar, "
    "o_expired boolean, o_lapsed boolean, o_response_status smallint, "
    "o_response_headers text, o_response_body bytea, o_expiring boolean"
)
BODY = """
BEGIN
  -- Outside any transaction, the claim's commit does not wait for its WAL flush.
  IF _alone THEN
    PERFORM set_config('synchronous_commit', 'off', true);
  END IF;
  RETURN QUERY
    WITH ins AS (
      INSERT INTO {table} ("scope", "key", "operation", "fingerprint", "status", "token",
        "created_at", "expires_at", "locked_until", "response_headers", "format_version")
      SELECT _scope, _key, _operation, _fingerprint, 'in_progress', _token,
        (statement_timestamp() + _now * interval '1 second'),
        (statement_timestamp() + _expires * interval '1 second'),
        (statement_timestamp() + _lease * interval '1 second'), '', 1
      WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE "scope" = _scope AND "key" = _key)
      ON CONFLICT ("scope", "key") DO NOTHING RETURNING 1)
    SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM ins
    UNION ALL
    SELECT "token", "operation", "fingerprint", "status",
      "expires_at" <= (statement_timestamp() + _now * interval '1 second'),
      "locked_until" <= (statement_timestamp() + _now * interval '1 second'),
      "response_status", "response_headers", "response_body",
      "expires_at" <= (statement_timestamp() + _soon * interval '1 second')
    FROM {table} WHERE "scope" = _scope AND "key" = _key;
END
"""


def _create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    table = apps.get_model("idempotency_app", "IdempotencyRecord")._meta.db_table
    body = BODY.format(table=schema_editor.quote_name(table))
    schema_editor.execute(
        f"CREATE OR REPLACE FUNCTION {NAME}({ARGUMENTS}) RETURNS TABLE ({RESULT}) "
        f"LANGUAGE plpgsql VOLATILE AS $body${body}$body$"
    )


def _drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {NAME}({ARGUMENTS})")


class Migration(migrations.Migration):
    dependencies = [("idempotency_app", "0006_created_index_in_list_order")]

    operations = [migrations.RunPython(_create, _drop, elidable=False)]
