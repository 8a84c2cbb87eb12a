"""Smoke tests of tests/servers.py: the harness fault tests stand on.

Each starts private servers on free ports and proves the behaviour a fault
test will rely on: a crash loses no committed row, a killed cache refuses
connections and comes back, pgbouncer really pools per transaction, the app
server replays, and a faked clock really is shifted.
"""

from __future__ import annotations

import email.utils
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests import servers
from tests.faults import harness as faults

pytestmark = faults.MARKS


def test_private_postgres_keeps_committed_rows_across_a_crash() -> None:
    psycopg = pytest.importorskip(
        "psycopg", reason="psycopg not installed: pip install -e '.[postgres]'"
    )
    with servers.private_postgres() as pg:
        assert pg.port not in servers.SHARED_PORTS
        with psycopg.connect(pg.conninfo(), autocommit=True) as conn:
            conn.execute("CREATE TABLE survivor (v text)")
            conn.execute("INSERT INTO survivor VALUES ('committed')")

        pg.crash()
        assert not pg.is_up()
        with pytest.raises(psycopg.OperationalError, match="refused"):
            psycopg.connect(pg.conninfo())

        pg.start()
        assert pg.is_up()
        with psycopg.connect(pg.conninfo()) as conn:
            assert conn.execute("SELECT v FROM survivor").fetchall() == [("committed",)]
        assert "automatic recovery in progress" in pg.log_tail()


def test_private_mariadb_keeps_committed_rows_across_a_kill() -> None:
    mysqldb = pytest.importorskip(
        "MySQLdb", reason="mysqlclient not installed: pip install -e '.[mysql]'"
    )

    def connect() -> Any:
        return mysqldb.connect(
            host=db.host, port=db.port, user=db.user, password="", database=db.dbname,
            connect_timeout=2,
        )  # fmt: skip

    with servers.private_mariadb() as db:
        conn = connect()
        cursor = conn.cursor()
        cursor.execute("SELECT @@character_set_database")
        assert cursor.fetchone() == ("utf8mb4",)
        cursor.execute("CREATE TABLE survivor (v varchar(20)) ENGINE=InnoDB")
        cursor.execute("INSERT INTO survivor VALUES ('committed')")
        conn.commit()
        conn.close()

        db.crash()
        assert not db.is_up()
        with pytest.raises(mysqldb.OperationalError):
            connect()

        db.start()
        conn = connect()
        cursor = conn.cursor()
        cursor.execute("SELECT v FROM survivor")
        assert cursor.fetchall() == (("committed",),)
        conn.close()


def test_private_redis_refuses_when_killed_and_answers_after_start() -> None:
    redis = pytest.importorskip("redis", reason="redis-py not installed: pip install django-redis")
    with servers.private_redis() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=1)
        client.set("k", "v")
        assert client.get("k") == b"v"

        server.kill()
        with pytest.raises(redis.exceptions.ConnectionError):
            client.get("k")

        server.start()
        assert client.ping()
        assert client.get("k") is None  # no persistence: a restart starts empty


def test_pgbouncer_pools_per_transaction_in_front_of_a_private_postgres() -> None:
    psycopg = pytest.importorskip(
        "psycopg", reason="psycopg not installed: pip install -e '.[postgres]'"
    )
    with servers.private_postgres() as pg, servers.pgbouncer(pg, pool_size=1) as bouncer:
        assert bouncer.settings_env()["IDEMPOTENCY_TEST_PGBOUNCER"] == "1"
        first = psycopg.connect(bouncer.conninfo(), autocommit=True)
        second = psycopg.connect(bouncer.conninfo(), autocommit=True)
        try:
            assert first.execute("SELECT current_database()").fetchone() == ("faults",)
            # One server connection, two open clients: only transaction pooling
            # lets the second run while the first is still connected.
            backend = first.execute("SELECT pg_backend_pid()").fetchone()
            assert second.execute("SELECT pg_backend_pid()").fetchone() == backend
        finally:
            first.close()
            second.close()

        admin = psycopg.connect(
            bouncer.conninfo("pgbouncer"),
            autocommit=True,
            cursor_factory=psycopg.ClientCursor,
        )  # the admin console speaks only the simple query protocol
        with admin:
            config = {row[0]: row[1] for row in admin.execute("SHOW CONFIG").fetchall()}
        assert config["pool_mode"] == "transaction"


def test_app_server_on_a_private_postgres_replays_a_key() -> None:
    pytest.importorskip("psycopg", reason="psycopg not installed: pip install -e '.[postgres]'")
    with servers.private_postgres() as pg:
        servers.prepare_database(pg.settings_env())
        with servers.app_server(pg.settings_env(), workers=2) as app:
            assert len(app.worker_pids()) == 2
            key = str(uuid.uuid4())
            first = servers.post(app.url, "/charges/", {"amount": 700}, key)
            assert first.status == 201, first.body
            assert first.headers.get("Idempotent-Replayed") is None

            again = servers.post(app.url, "/charges/", {"amount": 700}, key)
            assert again.status == 201, again.body
            assert again.headers["Idempotent-Replayed"] == "true"
            assert again.json() == first.json()

            other_user = servers.post(app.url, "/charges/", {"amount": 700}, key, ("bob", "pw"))
            assert other_user.status == 201
            assert other_user.json()["id"] != first.json()["id"]
        assert app.process.poll() is not None  # stopped on the way out


def test_faketime_shifts_the_wall_clock_of_the_server_and_its_python(tmp_path: Path) -> None:
    offset = 300.0
    sqlite_env = {"IDEMPOTENCY_TEST_DB": "sqlite", "IDEMPOTENCY_TEST_DB_NAME": str(tmp_path / "db")}
    servers.prepare_database(sqlite_env)
    with servers.app_server(sqlite_env, workers=1, threads=2, faketime="+5m") as app:
        # gunicorn's worker stamps the Date header from its own clock; the
        # view sleeps, which must work under the faked clock.
        response = servers.post(app.url, "/charges/", {"sleep": 0.2}, str(uuid.uuid4()))
        assert response.status == 201, response.body
        served = email.utils.parsedate_to_datetime(response.headers["Date"]).timestamp()
        assert abs(served - time.time() - offset) < 5

        # Any Python under the server's exact environment: wall clock shifted,
        # monotonic clock and sleeping intact (libfaketime 0.9.10 breaks both
        # unless told to leave the monotonic clock alone).
        probe = (
            "import datetime, threading, time\n"
            "start = time.monotonic(); time.sleep(0.2); threading.Event().wait(0.2)\n"
            "print(datetime.datetime.now().timestamp(), time.monotonic() - start)\n"
        )
        before = time.time()
        done = subprocess.run(
            [sys.executable, "-c", probe], env=app.env, capture_output=True, text=True,
            timeout=30, check=True,
        )  # fmt: skip
        faked, slept = map(float, done.stdout.split())
        assert abs(faked - before - offset) < 5
        assert 0.35 < slept < 5
