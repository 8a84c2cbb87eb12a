"""Settings for a standalone app server (gunicorn, see tests/servers.py).

tests/settings.py picks the backend from IDEMPOTENCY_TEST_DB*; outside the
test runner its NAME is used as is (no ``test_`` prefix). On top of that:

IDEMPOTENCY_TEST_CONN_MAX_AGE      seconds, or ``none`` for unlimited; default 0
IDEMPOTENCY_TEST_CONN_HEALTH_CHECKS  1: check a persistent connection before reuse
IDEMPOTENCY_TEST_DB_CONNECT_TIMEOUT  seconds (PostgreSQL, MySQL); default 5
IDEMPOTENCY_TEST_PGBOUNCER=1       PostgreSQL behind pgbouncer in transaction mode
IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY  a JSON object: the IDEMPOTENCY setting
IDEMPOTENCY_TEST_CACHE_PREFIX      Redis key prefix; default idempotency-server
"""

from __future__ import annotations

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import CACHES, DATABASES, DB

_max_age = os.environ.get("IDEMPOTENCY_TEST_CONN_MAX_AGE", "0").strip().lower()
_health_checks = os.environ.get("IDEMPOTENCY_TEST_CONN_HEALTH_CHECKS") == "1"
_connect_timeout = int(os.environ.get("IDEMPOTENCY_TEST_DB_CONNECT_TIMEOUT", "5"))
_pgbouncer = DB == "postgres" and os.environ.get("IDEMPOTENCY_TEST_PGBOUNCER") == "1"

for _db in DATABASES.values():
    _db["CONN_MAX_AGE"] = None if _max_age == "none" else int(_max_age)
    _db["CONN_HEALTH_CHECKS"] = _health_checks
    # A copy: tests/settings.py may share one OPTIONS dict between aliases.
    _options = dict(_db.get("OPTIONS", {}))
    if DB in ("postgres", "mysql"):
        # A paused or unroutable server must fail a request, not hang a worker.
        _options["connect_timeout"] = _connect_timeout
    if _pgbouncer:
        # Transaction pooling hands each transaction whichever server
        # connection is free. A statement psycopg 3 prepared on one connection
        # would be run where it was never prepared, and a named (server-side)
        # cursor would outlive its transaction's connection. (Django's psycopg
        # 3 backend already defaults prepare_threshold to None; this keeps it
        # so whatever the defaults become.)
        _options["prepare_threshold"] = None
        _db["DISABLE_SERVER_SIDE_CURSORS"] = True
    _db["OPTIONS"] = _options

if DB == "sqlite" and "IDEMPOTENCY_TEST_DB_NAME" in os.environ:
    # ":memory:" would give every connection its own empty database.
    DATABASES["default"]["NAME"] = os.environ["IDEMPOTENCY_TEST_DB_NAME"]

_idempotency = os.environ.get("IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY")
if _idempotency:
    IDEMPOTENCY = json.loads(_idempotency)
    if not isinstance(IDEMPOTENCY, dict):
        raise RuntimeError("IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY must be a JSON object.")

if "KEY_PREFIX" in CACHES["default"]:
    # tests/settings.py prefixes with its pid so test runs sharing a Redis
    # stay apart; the workers of one server must share one guard.
    CACHES["default"]["KEY_PREFIX"] = os.environ.get(
        "IDEMPOTENCY_TEST_CACHE_PREFIX", "idempotency-server"
    )

# Warnings (takeovers, fenced rollbacks, cache outages) and 500 tracebacks
# go to stderr, which is the server's log: fault tests read it.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        "idempotency_app": {"handlers": ["stderr"], "level": "INFO"},
        "django.request": {"handlers": ["stderr"], "level": "ERROR", "propagate": False},
    },
}
