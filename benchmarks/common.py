"""What the bench scripts share: the database, the schema and the machine notes."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "benchmarks.benchproject.settings"


def setup_django() -> None:
    """Configure Django with the bench settings, creating the database if missing."""
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    ensure_database()


def ensure_database() -> None:
    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    params = {
        "host": db["HOST"],
        "port": db["PORT"],
        "user": db["USER"],
        "password": db["PASSWORD"],
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **params) as conn:
        found = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]]
        ).fetchone()
        if found is None:
            conn.execute(f'CREATE DATABASE "{db["NAME"]}"')


def reset_schema() -> None:
    """Migrate, then empty the tables the benchmarks write to."""
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0, interactive=False)
    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE idempotency_app_idempotencyrecord, bench_ledgerentry, bench_charge "
            "RESTART IDENTITY"
        )
    flush_redis_prefix()


def flush_redis_prefix() -> None:
    from django.core.cache import cache

    cache.delete_pattern("*")  # type: ignore[attr-defined]


def machine() -> dict[str, str]:
    """Cores, CPU model and the versions that shape the figures."""
    from django.core.cache import cache
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('server_version'), current_setting('synchronous_commit')"
        )
        pg_version, sync_commit = cursor.fetchone()
    redis_info = cache.client.get_client().info("server")  # type: ignore[attr-defined]
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    packages = ("django", "djangorestframework", "psycopg", "gunicorn", "django-redis", "redis")
    versions = ", ".join(f"{name} {_version(name)}" for name in packages)
    return {
        "cores": str(os.cpu_count()),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": versions,
        "postgresql": f"{pg_version} (synchronous_commit={sync_commit})",
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
