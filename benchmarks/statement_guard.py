"""What the statement guard costs per statement, in process.

    .venv/bin/python -m benchmarks.statement_guard                    # SQLite
    .venv/bin/python -m benchmarks.statement_guard --database postgres
    .venv/bin/python -m benchmarks.statement_guard --database mysql
    .venv/bin/python -m benchmarks.statement_guard --library /path/to/checkout   # an older version

While idempotent work runs, every statement it sends passes through an
execute wrapper: on the records' database one that refuses what would end
the transaction (and asks the driver whether it is still open), on every
other database one that refuses what is not a read. This times the wrappers
alone, called with an ``execute`` that does nothing, inside an open
transaction on a real connection, so the driver's report is real too. Each
figure is the median of --rounds rounds of --calls calls, minus the same
call with no wrapper (the loop's own cost), in microseconds per statement.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import library_shim

STATEMENTS = {
    "ORM SELECT": 'SELECT "t"."id", "t"."label" FROM "t" WHERE "t"."id" = %s LIMIT 21',
    "ORM INSERT": 'INSERT INTO "t" ("label", "amount") VALUES (%s, %s) RETURNING "t"."id"',
    "raw SQL after a comment": "/* audit */ UPDATE t SET amount = amount + 1 WHERE id = %s",
    "two statements": "UPDATE t SET amount = 0 WHERE id = 1; SELECT amount FROM t WHERE id = 1",
}


def configure(database: str) -> None:
    from django.conf import settings

    if database == "sqlite":
        default: dict[str, Any] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    elif database == "postgres":
        default = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": os.environ.get("IDEMPOTENCY_BENCH_NAME", "test"),
            "HOST": "127.0.0.1",
            "USER": "postgres",
        }
    else:
        default = {
            "ENGINE": "django.db.backends.mysql",
            "NAME": os.environ.get("IDEMPOTENCY_BENCH_NAME", "test"),
            "HOST": "127.0.0.1",
            "USER": "root",
            "OPTIONS": {"charset": "utf8mb4"},
        }
    settings.configure(
        DATABASES={"default": default, "replica": dict(default)},
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "idempotency_app"],
        USE_TZ=True,
    )
    import django

    django.setup()


def per_call(function: Callable[[], Any], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls * 1e6


def measure(database: str, rounds: int, calls: int) -> list[tuple[str, str, float]]:
    from django.db import connections, transaction

    from idempotency_app import store

    try:
        from idempotency_app.lifecycle import work
    except ImportError:  # a checkout from before the lifecycle package
        from idempotency_app import work  # type: ignore[no-redef]

    identity = store.Identity("user:1", "bench-key", "POST charges/", "0" * 64)

    def noop(sql: Any, params: Any, many: bool, context: Any) -> None:
        return None

    figures = []
    with transaction.atomic():
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")  # the transaction is open, as in real work
        with work.confined(identity, "default"):
            for alias, where in (("default", "records' database"), ("replica", "other database")):
                connection = connections[alias]
                connection.ensure_connection()
                guard = connection.execute_wrappers[-1]
                with connection.cursor() as cursor:
                    context = {"connection": connection, "cursor": cursor}
                    for name, sql in STATEMENTS.items():
                        if alias == "replica" and "SELECT" not in sql.split()[0]:
                            continue  # a write there is refused: not a cost
                        guarded = functools.partial(guard, noop, sql, None, False, context)
                        bare = functools.partial(noop, sql, None, False, context)
                        samples = [
                            per_call(guarded, calls) - per_call(bare, calls) for _ in range(rounds)
                        ]
                        figures.append((where, name, statistics.median(samples)))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=("sqlite", "postgres", "mysql"), default="sqlite")
    parser.add_argument("--library", type=Path, help="measure this checkout's idempotency_app")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    shim = library_shim(args.library) if args.library else None
    if shim is not None:
        sys.path.insert(0, shim.name)
    configure(args.database)
    import idempotency_app

    print(f"library: {Path(idempotency_app.__file__).resolve().parent}, database: {args.database}")
    print(f"median of {args.rounds} rounds of {args.calls} calls, microseconds per statement\n")
    print("| where | statement | guard (us) |\n|---|---|---|")
    for where, name, micros in measure(args.database, args.rounds, args.calls):
        print(f"| {where} | {name} | {micros:.2f} |")


if __name__ == "__main__":
    main()
