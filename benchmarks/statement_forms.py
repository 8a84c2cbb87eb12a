"""Other ways of sending the library's statements, measured against the way it sends them (PostgreSQL).

    .venv/bin/python -m benchmarks.statement_forms [--batches 10] [--per-batch 200]

1. The claim through Django's cursor as the library sends it, a call of
   its PL/pgSQL function (migration 0007: the server plans it once per
   session), against the statement itself as text (parsed and planned on
   every claim, as before the function), and bound on the server without
   preparing (what binding on the server saves in client CPU, and what its
   extra protocol messages cost in wall time).
2. A transaction's first statement, a SAVEPOINT: sent as the library sends
   it (``BEGIN; SAVEPOINT`` in one message through libpq, one round trip)
   against psycopg's way (BEGIN, then the SAVEPOINT: two round trips) and
   both in one pipeline (one round trip, plus entering and leaving pipeline
   mode).

Each pair alternates in batches, so whatever else the machine does weighs
on both alike; medians of the batches' means, wall and CPU.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.common import (
    alternate,
    machine,
    print_machine,
    reset_schema,
    setup_django,
    table,
    use_database,
)


def claim_forms(connection: Any) -> dict[str, Callable[[], None]]:
    from psycopg import Cursor

    from idempotency_app import store
    from idempotency_app.store import Identity

    records = store.backend(connection.alias)
    assert records.claim_statement(True) == records.claim_calls[True], "migrate to 0007"

    def params() -> dict[str, Any]:
        identity = Identity("user:1", str(uuid.uuid4()), "POST charges/", "f" * 64)
        return records.claim_params(identity, uuid.uuid4().hex, 86400, 60)

    def client_side(sql: str) -> Callable[[], None]:
        def run() -> None:
            with connection.cursor() as cursor:
                cursor.execute(sql, params())
                cursor.fetchone()

        return run

    def server_side() -> None:
        with connection.wrap_database_errors:
            raw = Cursor(connection.connection)
        with connection.make_cursor(raw) as cursor:
            records.adapt(cursor.cursor)
            cursor.execute(records.claim_alone_sql, params())
            cursor.fetchone()

    return {
        "claim, its function (as sent)": client_side(records.claim_calls[True]),
        "claim, the statement as text": client_side(records.claim_alone_sql),
        "claim, the statement bound on the server, not prepared": server_side,
    }


def savepoint_forms(connection: Any) -> dict[str, Callable[[], None]]:
    from idempotency_app.store.postgresql import begin_with

    raw = connection.connection

    def in_one_message() -> None:
        assert begin_with(connection, 'SAVEPOINT "bench"')
        raw.rollback()

    def first_statement(piped: bool) -> Callable[[], None]:
        def run() -> None:
            with raw.cursor() as cursor:
                if piped:
                    with raw.pipeline():
                        cursor.execute('SAVEPOINT "bench"')
                else:
                    cursor.execute('SAVEPOINT "bench"')
            raw.rollback()

        return run

    return {
        "BEGIN; SAVEPOINT in one message (as sent)": in_one_message,
        "BEGIN, then SAVEPOINT (psycopg's way)": first_statement(False),
        "BEGIN and SAVEPOINT in one pipeline": first_statement(True),
    }


def compared(calls: dict[str, Callable[[], None]], rounds: int, per_batch: int) -> list[list[str]]:
    """Each form's wall and CPU time per call, and against the first."""

    def batch(call: Callable[[], None]) -> Callable[[], None]:
        def calls_in_a_batch() -> None:
            for _ in range(per_batch):
                call()

        return calls_in_a_batch

    wall, cpu = alternate({n: batch(c) for n, c in calls.items()}, rounds, per_batch)
    first = next(iter(calls))
    return [
        [
            name,
            f"{wall[name]:,.0f}",
            f"{cpu[name]:,.0f}",
            f"{wall[name] - wall[first]:+,.0f}",
            f"{cpu[name] - cpu[first]:+,.0f}",
        ]
        for name in calls
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--per-batch", type=int, default=200)
    args = parser.parse_args()
    use_database("postgres")
    setup_django()
    reset_schema()
    from django.db import connection

    print_machine(machine())
    connection.ensure_connection()
    rows = compared(claim_forms(connection), args.batches, args.per_batch)
    connection.connection.autocommit = False
    rows += compared(savepoint_forms(connection), args.batches, args.per_batch)
    connection.connection.autocommit = True
    headers = ["statement", "wall us", "CPU us", "wall vs as sent", "CPU vs as sent"]
    print(table(headers, rows))
    connection.close()
    reset_schema()


if __name__ == "__main__":
    main()
