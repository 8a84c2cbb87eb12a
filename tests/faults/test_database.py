"""A database crashed, then restarted, under load.

"Every answer a client got matches what committed; after recovery, every
intent retried runs exactly once; no 2xx for lost work; the app recovers
without a restart."

One private database (PostgreSQL: ``pg_ctl stop -m immediate``; MariaDB:
SIGKILL) behind one gunicorn whose workers keep their connections
(``CONN_MAX_AGE`` 60), so the connections really die with the server. Client
threads pursue their intents (a fresh key and label each; the view sleeps
between its two writes, so work is in flight) with the same key and body
until they get a 2xx. Once a quarter of the intents are done, the database
goes down for 1.5 s and comes back; the same app server, with the same
workers, keeps serving. Then a second load, with a clean restart instead of
a crash. After each, what committed is read straight from the database and
compared with every answer, and every intent is retried once more: each
must replay. (While the database is down, requests fail with a plain 500 in
DRF's Basic authentication, which reads the user table before the
idempotency layer runs; the requests in flight fail in the view's writes.)

A crash at a random instant rarely lands between a COMMIT and its reply,
where a client cannot know whether the work happened. The last test puts
it there on purpose: PostgreSQL waiting for a synchronous standby that
does not exist holds every COMMIT after it is durable, and the crash comes
then. The clients must hear 503 ``idempotency_store_unavailable`` (not a
success, and not "rolled back"), and their retries must replay the work,
which did commit.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests import servers
from tests.faults import harness as faults

pytestmark = faults.MARKS

CLIENTS = 7
INTENTS_PER_CLIENT = 24
DOWN_FOR = 1.5  # seconds the database stays down
LEASE = 3  # short, so that claims orphaned by the crash free soon


@pytest.mark.parametrize("vendor", ["postgres", "mariadb"])
def test_database_crash_and_restart_under_load(
    vendor: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with faults.private_database(vendor) as db:
        servers.prepare_database(db.settings_env())
        env = {
            **db.settings_env(),
            "IDEMPOTENCY_TEST_CONN_MAX_AGE": "60",
            "IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY": json.dumps({"LEASE": LEASE}),
        }
        with servers.app_server(env, workers=2) as app:
            workers = app.worker_pids()
            asked: set[str] = set()  # every label any intent carried, so far
            for fault in ("crash", "restart"):
                _load_through(capsys, fault, vendor, db, app, asked)
            assert app.worker_pids() == workers, "a worker died: the app did not recover by itself"


def _load_through(
    capsys: pytest.CaptureFixture[str],
    fault: str,
    vendor: str,
    db: faults.PrivateDatabase,
    app: servers.AppServer,
    asked: set[str],
) -> None:
    intents = faults.make_intents(f"{vendor}-{fault}", CLIENTS, INTENTS_PER_CLIENT, sleep=0.05)
    with faults.Load(app.url, intents) as load:
        load.wait_for(0.25)
        began = time.monotonic()
        if fault == "crash":
            db.crash()
        else:
            db.stop()
        time.sleep(DOWN_FOR)
        db.start()
        outage = time.monotonic() - began
    everyone = load.all
    during = [a for a in load.answers() if began <= a.started <= began + outage]

    committed = faults.Committed.read(db)
    problems = faults.check_intents(everyone, committed)
    labels = {intent.label for intent in everyone}
    asked |= labels
    strays = {label: rows for label, rows in committed.charges.items() if label not in asked}
    if committed.lone_ledger_entries:
        problems.append(f"{committed.lone_ledger_entries} ledger entries without a charge")
    stuck = [key for key, rec in committed.records.items() if rec.status != "completed"]
    if stuck:
        problems.append(f"{len(stuck)} claims left in progress: {stuck[:5]}")
    retried = faults.confirm_replays(app.url, everyone)

    faults.report(
        capsys,
        f"{vendor}-{fault}",
        f"down {outage:.1f} s ({faults.cut(load.answers(), began)} requests in flight cut, "
        f"{len(during)} sent meanwhile: {faults.outcomes(during)})",
        faults.load_figures(everyone),
        faults.executions(committed, sorted(labels)),
        f"after recovery {len(everyone)} retries: "
        + ("all byte-identical replays" if not retried else f"{len(retried)} not replays"),
        "no 2xx for lost work" if not problems else f"{len(problems)} problems",
    )
    assert app.process.poll() is None, "the app server died"
    faults.assert_no_problems(problems, f"answers that disagree with what committed ({fault})")
    faults.assert_no_problems(retried, f"retries after recovery that did not replay ({fault})")
    assert not strays, f"charges no intent asked for: {strays}"
    assert any(not a.ok for a in during), (
        f"the {fault} cost no request anything: the fault did not hit the load"
    )


IN_DOUBT = 4  # requests whose COMMIT is held when the database crashes

# Holds a COMMIT before it is durable: a deferred trigger runs at COMMIT,
# before the commit record is written, and this one sleeps there.
HOLD_BEFORE_DURABLE = """
CREATE FUNCTION faults_hold_commit() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN PERFORM pg_sleep(60); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER faults_hold_commit AFTER INSERT ON testapp_ledgerentry
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION faults_hold_commit();
"""


@pytest.mark.parametrize("commit", ["landed", "lost"])
def test_postgres_crash_while_commits_wait(commit: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The database crashes while COMMITs wait: either after they became
    durable (waiting for a synchronous standby that does not exist: the
    work committed) or before (in a deferred trigger: it did not). Either
    way the client cannot know, so it must get 503, and its retry must
    replay the work that landed, or run the lost work once."""
    psycopg = pytest.importorskip(
        "psycopg", reason="psycopg not installed: pip install -e '.[postgres]'"
    )
    with servers.private_postgres() as pg:
        env = _persistent_app_env(pg)
        with (
            servers.app_server(env, workers=2, threads=IN_DOUBT) as app,
            psycopg.connect(pg.conninfo(), autocommit=True) as admin,
        ):
            if commit == "lost":
                admin.execute(HOLD_BEFORE_DURABLE)
            # The work outlasts setting the hold after the last claim (a
            # configuration reload, slow on a loaded machine), within LEASE.
            intents = faults.make_intents(f"commit-{commit}", 1, IN_DOUBT, sleep=2.5)[0]
            senders = _send_each_once(app, intents)
            try:
                if commit == "landed":
                    faults.wait_until(
                        lambda: all(faults.claim_state(pg, i.key) for i in intents),
                        "every request claimed its key",
                    )
                    _hold_after_durable(admin)
                held = faults.wait_until(
                    lambda: _held_commits(admin, IN_DOUBT), "every request's COMMIT held"
                )
                pg.crash()
            finally:
                for sender in senders:
                    sender.join(timeout=90)
            pg.start()
            cut = [intent.answers[0] for intent in intents if intent.answers]
            assert len(cut) == IN_DOUBT, "a request whose COMMIT was held did not end"
            with psycopg.connect(pg.conninfo(), autocommit=True) as admin_again:
                admin_again.execute(
                    "DROP TRIGGER IF EXISTS faults_hold_commit ON testapp_ledgerentry"
                )
            for intent in intents:
                faults.pursue(app.url, intent, time.monotonic() + 60)
            committed = faults.Committed.read(pg)
            retried = faults.confirm_replays(app.url, intents)

    problems = []
    for answer in cut:
        if (answer.status, answer.code) != (503, "idempotency_store_unavailable"):
            problems.append(f"a request whose COMMIT was cut got {answer.describe()}")
    problems += faults.check_intents(intents, committed)
    replays = sum(i.successes[0].replayed for i in intents if i.successes)
    faults.report(
        capsys,
        f"postgres-commit-{commit}",
        f"{IN_DOUBT} requests crashed while their COMMIT was held ({held} held "
        f"{'after' if commit == 'landed' else 'before'} it was durable), "
        f"answered {faults.outcomes(cut)} {faults.errors_5xx(cut)}",
        f"their retries: {faults.summary([a for i in intents for a in i.answers[1:]])}",
        f"first 2xx: {replays} replays of work that committed, {IN_DOUBT - replays} fresh runs",
        faults.executions(committed, [i.label for i in intents]),
        f"after recovery {len(intents)} more retries: "
        + ("all byte-identical replays" if not retried else f"{len(retried)} not replays"),
    )
    faults.assert_no_problems(problems + retried, "answers that disagree with what committed")
    if commit == "landed":
        assert replays == IN_DOUBT, "the held commits did not land: the test proved nothing"
    else:
        assert replays == 0, "the held commits landed: the test proved nothing"


def _persistent_app_env(pg: servers.PrivatePostgres) -> dict[str, str]:
    """A prepared database, and an app server on it with persistent connections."""
    servers.prepare_database(pg.settings_env())
    return {
        **pg.settings_env(),
        "IDEMPOTENCY_TEST_CONN_MAX_AGE": "60",
        "IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY": json.dumps({"LEASE": LEASE}),
    }


def _send_each_once(app: servers.AppServer, intents: list[faults.Intent]) -> list[threading.Thread]:
    """Each intent's first request, all at once, each from its own thread."""
    senders = [
        threading.Thread(
            target=lambda i=i: i.answers.append(faults.send(app.url, "/charges/", i.body, i.key)),
            daemon=True,
        )
        for i in intents
    ]
    for sender in senders:
        sender.start()
    return senders


def _hold_after_durable(admin: Any) -> None:
    """From now on every COMMIT is durable, then waits for a synchronous
    standby that never comes; the next start forgets it."""
    admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
    admin.execute("SELECT pg_reload_conf()")
    faults.wait_until(
        lambda: admin.execute("SHOW synchronous_standby_names").fetchone() == ("nobody",),
        "the configuration reloaded",
    )
    # Written only once the reload has read the file: the crash's restart reads this.
    admin.execute("ALTER SYSTEM RESET synchronous_standby_names")


def _held_commits(admin: Any, at_least: int) -> int:
    """How many backends are held at COMMIT, once at least ``at_least`` are."""
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event IN ('SyncRep', 'PgSleep')"
    ).fetchone()
    return int(row[0]) if int(row[0]) >= at_least else 0


def test_postgres_commit_whose_answer_is_lost_is_still_a_success(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The COMMIT lands, then the server ends the session before the client
    hears so, while the database stays up: the layer reads the record back
    on a new connection and answers with the success that committed."""
    psycopg = pytest.importorskip(
        "psycopg", reason="psycopg not installed: pip install -e '.[postgres]'"
    )
    with servers.private_postgres() as pg:
        env = _persistent_app_env(pg)
        with (
            servers.app_server(env, workers=1, threads=IN_DOUBT) as app,
            psycopg.connect(pg.conninfo(), autocommit=True) as admin,
        ):
            # As above: the first claim's work must outlast the last claim and
            # the reload; 1.0 s did not on a loaded machine.
            intents = faults.make_intents("answer-lost", 1, IN_DOUBT, sleep=2.5)[0]
            senders = _send_each_once(app, intents)
            try:
                faults.wait_until(
                    lambda: all(faults.claim_state(pg, i.key) for i in intents),
                    "every request claimed its key",
                )
                _hold_after_durable(admin)
                faults.wait_until(lambda: _held_commits(admin, IN_DOUBT), "every COMMIT held")
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE wait_event = 'SyncRep'"
                )
            finally:
                for sender in senders:
                    sender.join(timeout=90)
            admin.execute("SELECT pg_reload_conf()")
            answers = [intent.answers[0] for intent in intents if intent.answers]
            committed = faults.Committed.read(pg)
            retried = faults.confirm_replays(app.url, intents)

    problems = [
        f"a request whose COMMIT landed got {a.describe()}"
        for a in answers
        if a.status != 201 or a.replayed
    ]
    faults.report(
        capsys,
        "postgres-commit-answer-lost",
        f"{IN_DOUBT} sessions ended at a durable COMMIT, the database up: "
        f"answered {faults.outcomes(answers)}",
        faults.executions(committed, [i.label for i in intents]),
        "retries: " + ("all byte-identical replays" if not retried else f"{len(retried)} not"),
    )
    problems += faults.check_intents(intents, committed)
    assert len(answers) == IN_DOUBT, "a request whose COMMIT was held did not end"
    faults.assert_no_problems(problems + retried, "answers that disagree with what committed")
