"""What the indexes of migrations 0004 and 0006 cost a claim and its completion.

    .venv/bin/python -m benchmarks.index_cost [--database mysql] [--pairs 3000]

Copies of the records table side by side: one with every index the
migrations create ("all"); one without 0006's creation-time B-tree on
(created_at, id) ("no created_at index"); on PostgreSQL one with 0004's BRIN
index on created_at in its place ("BRIN instead", the schema before 0006);
one without any of the indexes the two migrations add (scope, in-progress
leases, creation time: "none of them"); and on PostgreSQL one without the
indexes on the columns a completion changes (``expires_at``, and the lease
index whose predicate reads ``status``), so that the completion can be a HOT
update, which writes no index entry ("HOT completion"). The library's own claim and
completion statements run against every copy, alternating in batches so that
whatever else the machine does weighs on all alike, each pair on a fresh key
(the write path). Prints the median and p99 of a claim + completion per copy,
each against "none of them" and against "no created_at index", and on
PostgreSQL the share of completions that were HOT updates.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

from benchmarks.common import percentile, setup_django, table

SCOPE, LEASE, CREATED, EXPIRES = (
    "idempotency_scope_idx",
    "idempotency_lease_idx",
    "idempotency_created_id_idx",
    "idempotency_expires_idx",
)
BATCH = 50


def variants(vendor: str) -> dict[str, tuple[str, ...]]:
    """Each copy and the indexes it goes without."""
    found = {
        "all": (),
        "no created_at index": (CREATED,),
        "BRIN instead": (CREATED,),
        "none of them": (SCOPE, LEASE, CREATED),
        "HOT completion": (EXPIRES, LEASE),
    }
    if vendor != "postgresql":
        del found["BRIN instead"], found["HOT completion"]
    return found


def copies(connection: Any) -> dict[str, str]:
    """Create the copies; their table names by variant."""
    from idempotency_app.models import IdempotencyRecord

    q = connection.ops.quote_name
    source = IdempotencyRecord._meta.db_table
    names = {}
    with connection.cursor() as cursor:
        for number, (variant, dropped) in enumerate(variants(connection.vendor).items()):
            name = names[variant] = f"{source}_{number}"
            cursor.execute(f"DROP TABLE IF EXISTS {q(name)}")
            if connection.vendor == "postgresql":
                cursor.execute(f"CREATE TABLE {q(name)} (LIKE {q(source)} INCLUDING ALL)")
            else:
                cursor.execute(f"CREATE TABLE {q(name)} LIKE {q(source)}")
            for index in dropped:
                if connection.vendor == "postgresql":
                    cursor.execute(
                        "SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef LIKE %s",
                        [name, f"%({_column(index)}%"],
                    )
                    for (found,) in cursor.fetchall():
                        cursor.execute(f"DROP INDEX IF EXISTS {q(found)}")
                else:
                    cursor.execute(f"ALTER TABLE {q(name)} DROP INDEX {q(index)}")
            if variant == "BRIN instead":
                cursor.execute(f"CREATE INDEX ON {q(name)} USING brin (created_at)")
    return names


def _column(index: str) -> str:
    return {
        SCOPE: "scope",
        LEASE: "locked_until",
        CREATED: "created_at, id",
        EXPIRES: "expires_at",
    }[index]


def statements(connection: Any, table_name: str) -> tuple[str, str]:
    """The library's claim (outside a transaction) and completion, on ``table_name``."""
    from idempotency_app import store

    records = store.backend(connection.alias)
    claim = getattr(records, "claim_alone_sql", records.claim_sql)
    quoted = connection.ops.quote_name(table_name)
    return claim.replace(records.table, quoted), records.complete_sql.replace(records.table, quoted)


def pair(connection: Any, claim: str, complete: str) -> float:
    """One fresh claim and its completion; seconds."""
    from django.db import transaction

    from idempotency_app import store
    from idempotency_app.store import Identity, StoredResponse

    records = store.backend(connection.alias)
    identity = Identity("user:1", str(uuid.uuid4()), "POST charges/", "f" * 64)
    token = uuid.uuid4().hex
    response = StoredResponse(201, (), b'{"id": 1}')
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(claim, records.claim_params(identity, token, 86400, 60))
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            complete,
            {
                **records.params(identity, expires=86400),
                "token": token,
                "status": response.status,
                "headers": response.headers_json(),
                "body": response.body,
            },
        )
    return time.perf_counter() - started


def hot_shares(connection: Any, names: dict[str, str]) -> dict[str, str]:
    """On PostgreSQL, the share of each copy's updates that were HOT
    (its statistics arrive within a second or so of the updates)."""
    if connection.vendor != "postgresql":
        return {}
    time.sleep(1)
    shares = {}
    with connection.cursor() as cursor:
        for variant, name in names.items():
            cursor.execute(
                "SELECT n_tup_hot_upd, n_tup_upd FROM pg_stat_user_tables WHERE relname = %s",
                [name],
            )
            hot, updated = cursor.fetchone() or (0, 0)
            shares[variant] = f"{hot / updated:.0%}" if updated else "none"
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database", default="postgres", choices=("postgres", "mysql"))
    parser.add_argument(
        "--pairs", type=int, default=3000, help="claim + completion pairs per variant"
    )
    args = parser.parse_args()
    os.environ["IDEMPOTENCY_BENCH_DB"] = args.database
    setup_django()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0, interactive=False)
    names = copies(connection)
    plans = {variant: statements(connection, name) for variant, name in names.items()}
    times: dict[str, list[float]] = {variant: [] for variant in names}
    for _ in range(BATCH):  # warm-up
        for claim, complete in plans.values():
            pair(connection, claim, complete)
    order = list(plans)
    for round_ in range(args.pairs // BATCH):
        for variant in order[round_ % len(order) :] + order[: round_ % len(order)]:
            claim, complete = plans[variant]  # in turn first, so no copy always runs first
            times[variant] += [pair(connection, claim, complete) for _ in range(BATCH)]
    p50 = {variant: statistics.median(values) for variant, values in times.items()}
    hot = hot_shares(connection, names)
    rows = []
    for variant, values in times.items():
        rows.append([
            variant, len(values), f"{p50[variant] * 1000:.3f}",
            f"{percentile(values, 0.99) * 1000:.3f}",
            f"{p50[variant] / p50['none of them']:.3f}x",
            f"{p50[variant] / p50['no created_at index']:.3f}x",
            hot.get(variant, "n/a"),
        ])  # fmt: skip
    print(f"{connection.vendor}: a fresh claim + its completion, by the indexes of 0004 and 0006")
    headers = [
        "indexes", "pairs", "p50 ms", "p99 ms", "p50 / none", "p50 / no created_at", "HOT updates",
    ]  # fmt: skip
    print(table(headers, rows))
    with connection.cursor() as cursor:
        for name in names.values():
            cursor.execute(f"DROP TABLE IF EXISTS {connection.ops.quote_name(name)}")


if __name__ == "__main__":
    main()
