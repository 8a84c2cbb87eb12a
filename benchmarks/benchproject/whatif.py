"""Proposed changes to the app, simulated so they can be measured first.

Chosen with IDEMPOTENCY_BENCH_WHATIF (comma-separated), never on by default:

``async-claim``   the claim statement (PostgreSQL, atomic mode) also sets
                  ``synchronous_commit`` off for its own one-statement
                  transaction, so the claim's commit does not wait for a WAL
                  flush. The work's commit still waits, and WAL is flushed in
                  order, so a stored outcome is as durable as before; a crash
                  can only lose a claim whose work never committed.
``no-savepoint``  the decorated view opens ``atomic(savepoint=False)``: it
                  already runs in the decorator's transaction, so its own
                  block need not be a savepoint.

The SQL is rewritten on its way to the database; if the app's statement
changes shape, the rewrite raises instead of silently measuring nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

CLAIM_HEAD = "WITH ins AS (INSERT"
ASYNC_COMMIT = "RETURNING 1), cfg AS (SELECT set_config('synchronous_commit', 'off', true)) SELECT"


def enabled() -> frozenset[str]:
    raw = os.environ.get("IDEMPOTENCY_BENCH_WHATIF", "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def async_claim(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    if sql.startswith(CLAIM_HEAD) and not context["connection"].in_atomic_block:
        rewritten = sql.replace("RETURNING 1) SELECT", ASYNC_COMMIT, 1).replace(
            " FROM ins UNION ALL", " FROM ins CROSS JOIN cfg UNION ALL", 1
        )
        if rewritten.count("cfg") != 2:
            raise RuntimeError(
                "the claim statement changed shape; update benchmarks/benchproject/whatif.py"
            )
        sql = rewritten
    return execute(sql, params, many, context)


def install(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver: wrap each new connection's execute."""
    if "async-claim" in enabled() and async_claim not in connection.execute_wrappers:
        connection.execute_wrappers.append(async_claim)
