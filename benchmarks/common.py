"""What the bench scripts share: the databases, the schema and the machine notes."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

# The bench view's request body, and the token of its first principal, for
# requests sent in process through Django's test client.
BODY = json.dumps({"label": "bench", "amount": 100})
AUTH = {"HTTP_AUTHORIZATION": "Token bench-token-1"}

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "benchmarks.benchproject.settings"
VENDORS = {"postgres": "postgresql", "mysql": "mysql"}
# The tables the benchmarks write to, emptied before and after a run.
BENCH_TABLES = ("idempotency_app_idempotencyrecord", "bench_ledgerentry", "bench_charge")


def library_shim(checkout: Path) -> tempfile.TemporaryDirectory[str]:
    """A directory holding only a link to ``checkout``'s ``idempotency_app``.
    First on the import path, it makes that checkout's package win while the
    benchmarks still come from here, so one command measures an earlier
    version of the library (``python -m`` would otherwise put this checkout
    first, whatever ``PYTHONPATH`` says)."""
    package = checkout.resolve() / "idempotency_app"
    if not (package / "__init__.py").exists():
        raise RuntimeError(f"{checkout} holds no idempotency_app package")
    shim = tempfile.TemporaryDirectory(prefix="idempotency-bench-library-")
    (Path(shim.name) / "idempotency_app").symlink_to(package)
    return shim


def imports_from(path: str, checkout: Path) -> bool:
    """Whether ``path`` (an ``idempotency_app.__file__``) is ``checkout``'s package."""
    return Path(os.path.realpath(path)).parent == checkout.resolve() / "idempotency_app"


def git_describe(checkout: Path) -> str:
    """The commit a checkout is at, and whether its library has local changes."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(checkout), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(checkout), "status", "--porcelain", "--", "idempotency_app"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return rev + (" (+ uncommitted changes to idempotency_app)" if dirty else "")


def use_database(name: str) -> None:
    """Choose the backend (postgres or mysql) for this process and for every
    process it starts (gunicorn, micro.py, the sweep command), which read it
    from the environment through the bench settings."""
    os.environ["IDEMPOTENCY_BENCH_DB"] = name


def setup_django(settings: str = SETTINGS) -> None:
    """Configure Django with the bench settings, creating the databases if missing."""
    os.environ["DJANGO_SETTINGS_MODULE"] = settings
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    ensure_databases()


def vendor(alias: str = "default") -> str:
    from django.db import connections

    return str(connections[alias].vendor)


def ensure_databases() -> None:
    """The bench database and the home of the large tables: a schema of it on
    PostgreSQL, a database of its own on MariaDB (utf8mb4, as the app needs)."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    bench: str = settings.BENCH_NAME
    large: str = settings.LARGE
    if vendor() == "mysql":
        import MySQLdb

        conn = MySQLdb.connect(
            host=db["HOST"], port=int(db["PORT"]), user=db["USER"], password=db["PASSWORD"]
        )
        try:
            cursor = conn.cursor()
            for name in (bench, large):
                cursor.execute(f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4")
        finally:
            conn.close()
        return
    import psycopg

    params = {
        "host": db["HOST"],
        "port": db["PORT"],
        "user": db["USER"],
        "password": db["PASSWORD"],
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [bench]).fetchone()
        if found is None:
            conn.execute(f'CREATE DATABASE "{bench}"')
    with psycopg.connect(dbname=bench, autocommit=True, **params) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{large}"')


def truncate(tables: tuple[str, ...], alias: str = "default") -> None:
    """Empty ``tables`` and restart their ids, on either backend (MariaDB
    refuses to truncate a table that a foreign key points at unless the
    checks are off for the session)."""
    from django.db import connections

    connection = connections[alias]
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SET FOREIGN_KEY_CHECKS = 0")
            for table in tables:
                cursor.execute(f"TRUNCATE TABLE {table}")
            cursor.execute("SET FOREIGN_KEY_CHECKS = 1")
        else:
            cursor.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY")


def reset_schema() -> None:
    """Migrate, then empty the tables the benchmarks write to."""
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    truncate(BENCH_TABLES)
    flush_redis_prefix()


def flush_redis_prefix() -> None:
    from django.core.cache import cache

    cache.delete_pattern("*")  # type: ignore[attr-defined]


def database_notes() -> tuple[str, str]:
    """The database's name and version, with the setting that decides what a
    commit waits for: PostgreSQL's ``synchronous_commit``, InnoDB's
    ``innodb_flush_log_at_trx_commit`` (1: flushed at every commit)."""
    from django.db import connection

    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SELECT VERSION(), @@innodb_flush_log_at_trx_commit, @@sync_binlog")
            version, flush, sync_binlog = cursor.fetchone()
            name = "mariadb" if "mariadb" in str(version).lower() else "mysql"
            return name, (
                f"{version} (innodb_flush_log_at_trx_commit={flush}, sync_binlog={sync_binlog})"
            )
        cursor.execute(
            "SELECT current_setting('server_version'), current_setting('synchronous_commit')"
        )
        version, sync_commit = cursor.fetchone()
        return "postgresql", f"{version} (synchronous_commit={sync_commit})"


def machine() -> dict[str, str]:
    """Cores, CPU model and the versions that shape the figures."""
    from django.core.cache import cache

    database, version = database_notes()
    redis_info = cache.client.get_client().info("server")  # type: ignore[attr-defined]
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    packages = (
        "django",
        "djangorestframework",
        "psycopg",
        "mysqlclient",
        "gunicorn",
        "django-redis",
        "redis",
    )
    versions = ", ".join(f"{name} {_version(name)}" for name in packages)
    return {
        "cores": str(os.cpu_count()),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": versions,
        database: version,
        "statements": "prepared (server-side binding)"
        if os.environ.get("IDEMPOTENCY_BENCH_PREPARED") == "1"
        else "client-side binding, never prepared (Django's default)",
        "redis": str(redis_info.get("redis_version")),
        "load": load_average(),
    }


def load_average() -> str:
    """Other work on the machine shows here: the figures are only as quiet as it."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def print_machine(notes: dict[str, str]) -> None:
    print("Machine")
    for name, value in notes.items():
        print(f"  {name:<11} {value}")
    print()


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of unsorted ``values``."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def alternate(
    batches: dict[str, Callable[[], None]], rounds: int, per_batch: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU time per request of each scenario, in
    microseconds: each ``batches`` callable sends ``per_batch`` requests,
    once to warm up, then ``rounds`` times, the scenarios alternating so
    that whatever else the machine does weighs on all alike."""
    walls: dict[str, list[float]] = {name: [] for name in batches}
    cpus: dict[str, list[float]] = {name: [] for name in batches}
    for batch in batches.values():
        batch()
    for _ in range(rounds):
        for name, batch in batches.items():
            started, cpu = time.perf_counter(), time.process_time()
            batch()
            walls[name].append((time.perf_counter() - started) / per_batch * 1e6)
            cpus[name].append((time.process_time() - cpu) / per_batch * 1e6)
    return (
        {name: statistics.median(values) for name, values in walls.items()},
        {name: statistics.median(values) for name, values in cpus.items()},
    )


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table, so the output can be pasted into the README as it is."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join(lines)
