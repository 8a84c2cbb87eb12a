"""The bench project with ``REPLAY_CACHE`` on: retries of keys a worker
completed or replayed within the last seconds are answered from its memory.
``IDEMPOTENCY_BENCH_REPLAY_CACHE`` sets the seconds (default 5)."""

from __future__ import annotations

import os

from benchmarks.benchproject.settings import *  # noqa: F403
from benchmarks.benchproject.settings import IDEMPOTENCY

IDEMPOTENCY = {
    **IDEMPOTENCY,
    "REPLAY_CACHE": float(os.environ.get("IDEMPOTENCY_BENCH_REPLAY_CACHE", "5")),
}
