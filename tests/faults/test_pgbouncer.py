"""Through PgBouncer in transaction pooling mode.

"The race, crash and replay tests pass; document the settings it needs."

A private PostgreSQL, pgbouncer in front of it (``pool_mode = transaction``,
10 server connections), and one gunicorn (2 workers of 8 threads) whose
Django connects through pgbouncer with the settings transaction pooling
needs: ``prepare_threshold = None`` (no prepared statements, which would
follow a server connection the next transaction may not get) and
``DISABLE_SERVER_SIDE_CURSORS`` (tests/server_settings.py, set by
``IDEMPOTENCY_TEST_PGBOUNCER=1``). pgbouncer itself runs with
``server_login_retry = 1``: its default of 15 s keeps every client waiting
that long after the database is back. Run with and without persistent
connections (``CONN_MAX_AGE``).

- race: 16 concurrent requests with one key to a slow view run it once;
- replay: retries of the completed key, concurrent too, replay its bytes;
- killed worker: the worker serving a slow request is SIGKILLed (gunicorn
  starts another); its claim is orphaned, a retry gets 409 until the lease
  lapses by the database's clock, then runs once, leaving no partial rows;
- database crash: PostgreSQL crashes under a small load and comes back;
  every intent ends with one execution and answers that match it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import pytest

from tests import servers
from tests.faults import harness as faults

pytestmark = faults.MARKS

LEASE = 3  # short, so the killed worker's claim frees soon
SLOW = 5  # seconds the view sleeps in the request whose worker is killed


@pytest.mark.parametrize("conn_max_age", ["0", "60"])
def test_through_pgbouncer_in_transaction_pooling(
    conn_max_age: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("psycopg", reason="psycopg not installed: pip install -e '.[postgres]'")
    with servers.private_postgres() as pg:
        servers.prepare_database(pg.settings_env())
        with servers.pgbouncer(pg) as bouncer:
            _set_pgbouncer(bouncer, server_login_retry="1")
            env = {
                **bouncer.settings_env(),
                "IDEMPOTENCY_TEST_CONN_MAX_AGE": conn_max_age,
                "IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY": json.dumps({"LEASE": LEASE}),
            }
            with servers.app_server(env, workers=2, threads=8) as app:
                name = f"pgbouncer-conn-max-age-{conn_max_age}"
                try:
                    race = _race_and_replay(app, pg)
                    killed = _killed_worker(app, pg)
                    crashed = _database_crash(app, pg)
                finally:
                    log = app.log.read_text(errors="replace")
                faults.report(capsys, name, race, killed, crashed)
    assert "Took over the lapsed claim" in log, log[-3000:]


def _set_pgbouncer(bouncer: servers.PgBouncer, **settings: str) -> None:
    """SET through pgbouncer's admin console (simple query protocol only)."""
    import psycopg

    with psycopg.connect(
        bouncer.conninfo("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor
    ) as admin:
        for name, value in settings.items():
            admin.execute(f"SET {name} = {value}")
        config = {row[0]: row[1] for row in admin.execute("SHOW CONFIG").fetchall()}
    assert config["pool_mode"] == "transaction"
    assert all(config[name] == value for name, value in settings.items()), config


def _race_and_replay(app: servers.AppServer, pg: servers.PrivatePostgres) -> str:
    key, label = str(uuid.uuid4()), f"pgbouncer-race-{uuid.uuid4().hex[:8]}"
    body = {"label": label, "amount": 1, "sleep": 0.5}
    racers = 16
    start = threading.Barrier(racers)
    raced: list[faults.Answer] = []

    def racer(_: int) -> None:
        start.wait()
        raced.append(faults.send(app.url, "/charges/", body, key))

    faults.run_threads(racer, racers)
    fresh = [a for a in raced if a.status == 201 and not a.replayed]
    assert len(fresh) == 1, f"{faults.outcomes(raced)}: {[a.describe() for a in raced]}"
    original = fresh[0]
    for answer in raced:
        assert (
            answer is original
            or (answer.status, answer.code) == (409, "request_in_progress")
            or (answer.replayed and (answer.status, answer.body) == (201, original.body))
        ), answer.describe()

    replays: list[faults.Answer] = [faults.send(app.url, "/charges/", body, key) for _ in range(4)]
    faults.run_threads(
        lambda _: replays.append(faults.send(app.url, "/charges/", body, key)), racers
    )
    for answer in replays:
        assert answer.replayed and (answer.status, answer.body) == (201, original.body), (
            answer.describe(),
            answer.body,
        )
    committed = faults.Committed.read(pg)
    assert [(c.id, c.ledger_entries) for c in committed.charges[label]] == [
        (original.json()["id"], 1)
    ]
    return (
        f"race: {racers} concurrent requests {faults.outcomes(raced)} "
        f"({sum(a.replayed for a in raced)} replays), 1 charge; "
        f"replay: {len(replays)} retries ({racers} concurrent) all byte-identical, "
        f"{faults.latency(replays)}"
    )


def _killed_worker(app: servers.AppServer, pg: servers.PrivatePostgres) -> str:
    key, label = str(uuid.uuid4()), f"pgbouncer-killed-{uuid.uuid4().hex[:8]}"
    body = {"label": label, "amount": 1, "sleep": SLOW}
    before = set(app.worker_pids())
    pending = faults.Pending(app.url, "/charges/", body, key)
    faults.wait_until(lambda: faults.claim_state(pg, key), "the slow request claimed its key")
    worker = faults.wait_until(
        lambda: faults.worker_serving(app, pending.local_port), "the worker serving it"
    )
    os.kill(worker, signal.SIGKILL)
    cut = pending.answer()
    assert cut.status is None, f"the killed worker answered {cut.describe()}"
    faults.wait_until(
        lambda: worker not in app.worker_pids() and len(app.worker_pids()) == len(before),
        "gunicorn replacing the killed worker",
    )

    state = faults.claim_state(pg, key)
    assert state is not None and state[0] == "in_progress", f"the orphaned claim is {state}"
    intent = faults.Intent(key, body)
    faults.pursue(app.url, intent, time.monotonic() + 60)
    first = intent.answers[0]
    left = state[1]
    if left is not None and left > 1.0:
        # Still well inside its lease when we looked: the retry must wait.
        assert (first.status, first.code) == (409, "request_in_progress"), first.describe()
    last = intent.answers[-1]
    assert last.status == 201 and not last.replayed, [a.describe() for a in intent.answers]
    waits = intent.answers[:-1]
    assert all((a.status, a.code) == (409, "request_in_progress") for a in waits), [
        a.describe() for a in intent.answers
    ]
    committed = faults.Committed.read(pg)
    assert [(c.id, c.ledger_entries) for c in committed.charges[label]] == [
        (last.json()["id"], 1)
    ], committed.charges[label]
    assert committed.lone_ledger_entries == 0
    waited = last.started - cut.started - cut.latency
    return (
        f"killed worker: claim orphaned with {left:.1f} s of lease left, retries "
        f"{faults.outcomes(intent.answers)}, the one that ran was sent {waited:.1f} s after "
        "the kill, 1 charge and 1 ledger entry"
    )


def _database_crash(app: servers.AppServer, pg: servers.PrivatePostgres) -> str:
    intents = faults.make_intents("pgbouncer-crash", 4, 12, sleep=0.05)
    with faults.Load(app.url, intents) as load:
        load.wait_for(0.25)
        began = time.monotonic()
        pg.crash()
        time.sleep(1.5)
        pg.start()
        outage = time.monotonic() - began
    everyone = load.all
    committed = faults.Committed.read(pg)
    problems = faults.check_intents(everyone, committed)
    problems += faults.confirm_replays(app.url, everyone)
    faults.assert_no_problems(problems, "answers that disagree with what committed")
    return (
        f"database crash: down {outage:.1f} s, {faults.cut(load.answers(), began)} requests "
        f"in flight cut, {faults.load_figures(everyone)}, "
        f"{faults.executions(committed, [i.label for i in everyone])}, "
        f"{len(everyone)} retries after recovery all replays"
    )
