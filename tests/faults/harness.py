"""What the fault-injection tests (tests/faults/) share.

A client that behaves as the README asks (one key per intent, the same key
and body on every retry, ``Retry-After`` honoured), a load of such clients on
threads, a reader of what committed on a private database, the checks that
compare every answer a client got with what committed, and the one line of
figures each test prints.

The servers themselves come from tests/servers.py: every one is private, on
its own port, and stopped by its context manager, also when a test fails.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import sys
import threading
import time
import uuid
from base64 import b64encode
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import servers

# For each test module: ``pytestmark = faults.MARKS`` (tests/conftest.py
# skips them unless IDEMPOTENCY_FAULT_TESTS=1).
MARKS = [pytest.mark.slow, pytest.mark.faults]

# The app's tables, as Django names them.
CHARGES = "testapp_charge"
LEDGER = "testapp_ledgerentry"
RECORDS = "idempotency_app_idempotencyrecord"


# ------------------------------------------------------------------ answers


@dataclass(frozen=True)
class Answer:
    """One request and what came back: a status, or no answer at all."""

    started: float  # time.monotonic() when it was sent
    latency: float  # seconds until the whole answer was read (or the error)
    status: int | None = None  # None: connection error or timeout
    error: str = ""  # "conn-error" or "timeout" when there was no answer
    body: bytes = b""
    replayed: bool = False
    retry_after: float | None = None
    date: str = ""  # the server's Date header
    tag: str = ""  # what the test sent, when it sends several kinds

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def outcome(self) -> int | str:
        return self.status if self.status is not None else self.error

    @property
    def code(self) -> str:
        """The ``code`` of a JSON error body; "" for anything else."""
        if self.status is None or self.status < 400:
            return ""
        try:
            data = json.loads(self.body)
        except ValueError:
            return ""
        return str(data.get("code", "")) if isinstance(data, dict) else ""

    def json(self) -> Any:
        return json.loads(self.body)

    def describe(self) -> str:
        if self.status is None:
            return self.error
        extra = f" {self.code}" if self.code else ""
        return f"{self.status}{extra}{' (replayed)' if self.replayed else ''}"


def send(
    url: str,
    path: str,
    body: Any,
    key: str | None,
    timeout: float = 30.0,
    auth: tuple[str, str] = servers.USERS[0],
) -> Answer:
    """One POST; a connection error or timeout is an answer too."""
    started = time.monotonic()
    try:
        response = servers.post(url, path, body, key, auth=auth, timeout=timeout)
    except TimeoutError:
        return Answer(started, time.monotonic() - started, error="timeout")
    except (OSError, http.client.HTTPException):
        return Answer(started, time.monotonic() - started, error="conn-error")
    retry_after = response.headers.get("Retry-After")
    return Answer(
        started,
        time.monotonic() - started,
        status=response.status,
        body=response.body,
        replayed=response.headers.get("Idempotent-Replayed") == "true",
        retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
        date=response.headers.get("Date", ""),
    )


class Pending:
    """A POST sent on a connection of its own whose answer is read later,
    so that a test can act (kill the worker serving it) meanwhile."""

    def __init__(self, url: str, path: str, body: Any, key: str, timeout: float = 60.0) -> None:
        host, _, port = url.split("://", 1)[-1].partition("/")[0].partition(":")
        self.started = time.monotonic()
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        self.conn.connect()
        assert self.conn.sock is not None
        self.local_port: int = self.conn.sock.getsockname()[1]
        user, password = servers.USERS[0]
        token = b64encode(f"{user}:{password}".encode()).decode()
        self.conn.request(
            "POST", path, body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Idempotency-Key": key,
                     "Authorization": f"Basic {token}"},
        )  # fmt: skip

    def answer(self) -> Answer:
        try:
            response = self.conn.getresponse()
            body = response.read()
        except TimeoutError:
            return Answer(self.started, time.monotonic() - self.started, error="timeout")
        except (OSError, http.client.HTTPException):
            return Answer(self.started, time.monotonic() - self.started, error="conn-error")
        finally:
            self.conn.close()
        return Answer(
            self.started, time.monotonic() - self.started, status=response.status, body=body,
            replayed=response.headers.get("Idempotent-Replayed") == "true",
        )  # fmt: skip


def worker_serving(app: servers.AppServer, client_port: int) -> int | None:
    """The gunicorn worker that accepted the connection from ``client_port``:
    the socket's inode in /proc/net/tcp, found among the workers' fds."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if int(local.rsplit(":", 1)[1], 16) == app.port and (
            int(remote.rsplit(":", 1)[1], 16) == client_port and inode != "0"
        ):
            inodes.add(f"socket:[{inode}]")
    for pid in app.worker_pids():
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return pid
    return None


# ------------------------------------------------------------------ intents


@dataclass
class Intent:
    """One thing a client wants done once: a key and a body, retried as is."""

    key: str
    body: dict[str, Any]
    answers: list[Answer] = field(default_factory=list)
    finished: bool = False  # its client is done with it

    @property
    def label(self) -> str:
        return str(self.body["label"])

    @property
    def successes(self) -> list[Answer]:
        return [a for a in self.answers if a.ok]


def make_intents(name: str, clients: int, per_client: int, **body: Any) -> list[list[Intent]]:
    """``clients`` lists of ``per_client`` intents, each with a fresh key and
    a label no other intent (in any test) uses."""
    run = uuid.uuid4().hex[:8]
    return [
        [
            Intent(str(uuid.uuid4()), {"label": f"{name}-{run}-{c}-{i}", "amount": 1, **body})
            for i in range(per_client)
        ]
        for c in range(clients)
    ]


def backoff(answer: Answer, attempt: int) -> float:
    """How long a well-behaved client waits before retrying: ``Retry-After``
    on 409 and 503, else a short exponential backoff."""
    if answer.status in (409, 503) and answer.retry_after is not None:
        return min(answer.retry_after, 2.0)
    return min(0.1 * 2 ** min(attempt, 4), 1.0)


def pursue(
    url: str,
    intent: Intent,
    deadline: float,
    path: str = "/charges/",
    stop: threading.Event | None = None,
    timeout: float = 30.0,
) -> None:
    """Send the intent until it gets a 2xx (or ``deadline`` passes), with
    the same key and body every time."""
    attempt = 0
    while stop is None or not stop.is_set():
        answer = send(url, path, intent.body, intent.key, timeout=timeout)
        intent.answers.append(answer)
        if answer.ok or time.monotonic() >= deadline:
            return
        time.sleep(backoff(answer, attempt))
        attempt += 1


class Load:
    """Client threads, each working through its own list of intents one by
    one: ``client(load, intent)``, by default ``pursue`` until a 2xx.

    Used as a context manager: the threads start on entry; on exit they are
    joined, and told to stop first if the block failed.
    """

    def __init__(
        self,
        url: str,
        intents: list[list[Intent]],
        deadline: float = 150.0,
        path: str = "/charges/",
        timeout: float = 30.0,
        client: Callable[[Load, Intent], None] | None = None,
    ) -> None:
        self.url, self.intents, self.path, self.timeout = url, intents, path, timeout
        self.client = client or Load.pursue
        self.deadline = time.monotonic() + deadline
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(mine,), daemon=True) for mine in intents
        ]
        self.started = 0.0
        self.elapsed = 0.0

    def pursue(self, intent: Intent) -> None:
        pursue(self.url, intent, self.deadline, self.path, self.stop, self.timeout)

    def _client(self, mine: list[Intent]) -> None:
        for intent in mine:
            if self.stop.is_set():
                return
            self.client(self, intent)
            intent.finished = True

    @property
    def all(self) -> list[Intent]:
        return [intent for mine in self.intents for intent in mine]

    def progress(self) -> float:
        """The fraction of intents their clients are done with."""
        everything = self.all
        return sum(intent.finished for intent in everything) / len(everything)

    def wait_for(self, fraction: float, timeout: float = 90.0) -> None:
        """Until ``fraction`` of the intents are done: the load is under way."""
        limit = time.monotonic() + timeout
        while self.progress() < fraction:
            if time.monotonic() > limit:
                raise AssertionError(
                    f"the load did not reach {fraction:.0%} in {timeout:.0f} s "
                    f"({self.progress():.0%} done): {summary(self.answers())}"
                )
            time.sleep(0.02)

    def answers(self) -> list[Answer]:
        return [a for intent in self.all for a in list(intent.answers)]

    def __enter__(self) -> Load:
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.stop.set()
        for thread in self.threads:
            thread.join(timeout=max(1.0, self.deadline - time.monotonic() + 60))
        self.elapsed = time.monotonic() - self.started
        alive = [t for t in self.threads if t.is_alive()]
        if alive and exc[0] is None:
            raise AssertionError(f"{len(alive)} client threads did not finish")


def run_threads(target: Callable[[int], None], count: int, timeout: float = 120.0) -> None:
    """``target(i)`` on ``count`` threads at once; re-raise the first failure."""
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "threads did not finish"


# ------------------------------------------------------------ what committed

PrivateDatabase = servers.PrivatePostgres | servers.PrivateMariaDB


@contextlib.contextmanager
def private_database(vendor: str) -> Iterator[PrivateDatabase]:
    """A private PostgreSQL or MariaDB (see tests/servers.py)."""
    if vendor == "postgres":
        pytest.importorskip("psycopg", reason="psycopg not installed: pip install -e '.[postgres]'")
        with servers.private_postgres() as pg:
            yield pg
    else:
        pytest.importorskip(
            "MySQLdb", reason="mysqlclient not installed: pip install -e '.[mysql]'"
        )
        with servers.private_mariadb() as db:
            yield db


def query(db: PrivateDatabase, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` read on a connection of our own, straight from the
    private server (never through the app, nor through pgbouncer).
    ``{q}`` quotes as the vendor does: write ``{q}key{q}``."""
    if isinstance(db, servers.PrivatePostgres):
        import psycopg

        with psycopg.connect(db.conninfo(), autocommit=True) as conn:
            return [tuple(row) for row in conn.execute(sql.format(q='"'), params).fetchall()]
    import MySQLdb

    conn = MySQLdb.connect(
        host=db.host, port=db.port, user=db.user, password="", database=db.dbname,
        connect_timeout=5, charset="utf8mb4",
    )  # fmt: skip
    try:
        cursor = conn.cursor()
        cursor.execute(sql.format(q="`"), params or None)
        return [tuple(row) for row in cursor.fetchall()]
    finally:
        conn.close()


@dataclass(frozen=True)
class Charge:
    id: int
    amount: int
    ledger_entries: int


@dataclass(frozen=True)
class Record:
    status: str
    response_status: int | None
    body: bytes | None


@dataclass
class Committed:
    """What the database holds after the load: charges by label, ledger
    entries without a charge, idempotency records by key."""

    charges: dict[str, list[Charge]]
    lone_ledger_entries: int
    records: dict[str, Record]

    @classmethod
    def read(cls, db: PrivateDatabase) -> Committed:
        charges: dict[str, list[Charge]] = {}
        for charge_id, label, amount, entries in query(
            db,
            f"SELECT c.id, c.label, c.amount, (SELECT COUNT(*) FROM {LEDGER} l "
            f"WHERE l.charge_id = c.id) FROM {CHARGES} c ORDER BY c.id",
        ):
            charges.setdefault(label, []).append(Charge(charge_id, amount, int(entries)))
        ((lone,),) = query(
            db,
            f"SELECT COUNT(*) FROM {LEDGER} l LEFT JOIN {CHARGES} c ON c.id = l.charge_id "
            "WHERE c.id IS NULL",
        )
        records = {
            key: Record(status, status_code, None if body is None else bytes(body))
            for key, status, status_code, body in query(
                db, f"SELECT {{q}}key{{q}}, status, response_status, response_body FROM {RECORDS}"
            )
        }
        return cls(charges, int(lone), records)

    def executions(self, labels: Sequence[str]) -> Counter[int]:
        """How many intents ran how many times (charges per label)."""
        return Counter(len(self.charges.get(label, [])) for label in labels)


def claim_state(db: PrivateDatabase, key: str) -> tuple[str, float | None] | None:
    """The key's record: its status, and the seconds its lease has left by
    the database's clock (negative once lapsed; None when completed)."""
    if isinstance(db, servers.PrivatePostgres):
        left = "EXTRACT(EPOCH FROM locked_until - statement_timestamp())"
    else:
        left = "TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) / 1000000"
    rows = query(db, f"SELECT status, {left} FROM {RECORDS} WHERE {{q}}key{{q}} = %s", [key])
    if not rows:
        return None
    status, seconds_left = rows[0]
    return str(status), None if seconds_left is None else float(seconds_left)


def wait_until(ready: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``ready`` until it returns something true, and return that."""
    limit = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > limit:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.02)


def check_intents(intents: Sequence[Intent], committed: Committed) -> list[str]:
    """Every way the answers of ``intents`` disagree with what committed.

    - each intent got a 2xx, and exactly one Charge with its label committed,
      with one LedgerEntry;
    - every 2xx body names that Charge (no success for lost work);
    - the first 2xx is a fresh execution, unless an earlier answer left the
      outcome open (no answer, 503, a plain 500): then it may be a replay;
    - every later 2xx is a replay with the same bytes;
    - after a 500 ``request_rolled_back`` ("nothing was kept"), the next 2xx
      before any open answer is a fresh execution, not a replay;
    - the key's record is completed with the same status and body.
    """
    problems: list[str] = []
    for intent in intents:
        trail = ", ".join(a.describe() for a in intent.answers)
        where = f"{intent.label} (answers: {trail})"
        rows = committed.charges.get(intent.label, [])
        if len(rows) != 1:
            problems.append(f"{len(rows)} charges committed for {where}")
        elif rows[0].ledger_entries != 1:
            problems.append(f"charge {rows[0].id} has {rows[0].ledger_entries} ledger entries")
        successes = intent.successes
        if not successes:
            problems.append(f"no 2xx for {where}")
            continue
        first = successes[0]
        for answer in successes:
            try:
                data = answer.json()
            except ValueError:
                problems.append(f"a 2xx body is not JSON for {where}: {answer.body[:80]!r}")
                continue
            committed_ids = [row.id for row in rows]
            if data.get("id") not in committed_ids or data.get("label") != intent.label:
                problems.append(
                    f"2xx for work that did not commit: {data} vs charges {committed_ids} "
                    f"for {where}"
                )
        for answer in successes[1:]:
            if not answer.replayed or answer.body != first.body:
                problems.append(f"a later 2xx is not a byte-identical replay for {where}")
        before = intent.answers[: intent.answers.index(first)]
        if first.replayed and not any(_open(a) for a in before):
            problems.append(f"the first 2xx is a replay, but no answer before was open: {where}")
        for i, answer in enumerate(intent.answers):
            if answer.code != "request_rolled_back":
                continue
            for later in intent.answers[i + 1 :]:
                if _open(later):
                    break
                if later.ok:
                    if later.replayed:
                        problems.append(f"request_rolled_back, yet its work committed: {where}")
                    break
        record = committed.records.get(intent.key)
        if record is None or record.status != "completed":
            problems.append(f"the record is {record} for {where}")
        elif record.response_status != first.status or record.body != first.body:
            problems.append(f"the stored response differs from the 2xx for {where}")
    return problems


def _open(answer: Answer) -> bool:
    """An answer after which the work may or may not have committed."""
    return (
        answer.status is None
        or answer.status == 503
        or (answer.status == 500 and answer.code == "")
    )


def confirm_replays(url: str, intents: Sequence[Intent], path: str = "/charges/") -> list[str]:
    """Retry every intent once more, now the fault is over: each must replay
    its first 2xx byte for byte. Returns the problems."""
    problems = []
    for intent in intents:
        answer = send(url, path, intent.body, intent.key)
        first = intent.successes[0] if intent.successes else None
        same = first is not None and (answer.status, answer.body) == (first.status, first.body)
        if not (same and answer.replayed):
            problems.append(
                f"{intent.label}: the retry got {answer.describe()} {answer.body[:80]!r}"
            )
    return problems


def assert_no_problems(problems: Sequence[str], what: str) -> None:
    shown = "\n  ".join(problems[:15])
    more = f"\n  ... and {len(problems) - 15} more" if len(problems) > 15 else ""
    assert not problems, f"{len(problems)} {what}:\n  {shown}{more}"


# ------------------------------------------------------------------ figures


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(fraction * len(ordered) + 0.5)))
    return ordered[rank - 1]


def seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


def _sort_key(item: tuple[int | str, int]) -> tuple[int, str]:
    outcome = item[0]
    return (0, f"{outcome:03d}") if isinstance(outcome, int) else (1, outcome)


def outcomes(answers: Sequence[Answer]) -> dict[int | str, int]:
    """Answers counted by status ("conn-error" or "timeout" when there was none)."""
    return dict(sorted(Counter(a.outcome for a in answers).items(), key=_sort_key))


def errors_5xx(answers: Sequence[Answer]) -> dict[str, int]:
    """5xx counted by their code; a 500 without one is "plain 500"."""
    counted = Counter(
        a.code or f"plain {a.status}" for a in answers if a.status is not None and a.status >= 500
    )
    return dict(sorted(counted.items()))


def latency(answers: Sequence[Answer]) -> str:
    times = [a.latency for a in answers]
    return (
        f"latency p50 {seconds(statistics.median(times) if times else 0)} "
        f"p99 {seconds(percentile(times, 0.99))} max {seconds(max(times, default=0))}"
    )


def summary(answers: Sequence[Answer]) -> str:
    return f"{len(answers)} requests, outcomes {outcomes(answers)}"


def load_figures(intents: Sequence[Intent]) -> str:
    """Requests, outcomes, 5xx by code, retries and latency of a load."""
    answers = [a for intent in intents for a in intent.answers]
    retries = [len(intent.answers) - 1 for intent in intents]
    hit = sum(1 for intent in intents if any(not a.ok for a in intent.answers))
    replayed_first = sum(1 for i in intents if i.successes and i.successes[0].replayed)
    return (
        f"{len(intents)} intents, {summary(answers)}, 5xx by code {errors_5xx(answers) or 'none'}, "
        f"intents that needed a retry {hit}, first 2xx a replay {replayed_first}, "
        f"retries per intent max {max(retries, default=0)}, {latency(answers)}"
    )


def cut(answers: Sequence[Answer], at: float) -> int:
    """Requests in flight at ``at`` (sent, not yet answered: in a worker or
    queued for one) that got no 2xx: the ones the fault cut."""
    return sum(1 for a in answers if a.started < at < a.started + a.latency and not a.ok)


def executions(committed: Committed, labels: Sequence[str], noun: str = "intent") -> str:
    """How many times each intent's work committed (its charges)."""
    counted = committed.executions(labels)
    if set(counted) == {1}:
        return f"executions per {noun}: all 1"
    return f"executions per {noun}: " + ", ".join(
        f"{n} ran {times}x" for times, n in sorted(counted.items())
    )


def report(capsys: pytest.CaptureFixture[str], name: str, *parts: str) -> None:
    """One line of figures on the real terminal, whether the test passes or
    not. Under pytest's default capture even ``sys.__stderr__`` (fd 2) is
    captured, so capture is suspended while the line is written."""
    line = f"FAULT {name}: " + ", ".join(p for p in parts if p)
    with capsys.disabled():
        print(f"\n{line}", file=sys.__stderr__, flush=True)


def server_log(*apps: servers.AppServer) -> str:
    """The tail of each app server's log, for an assertion message."""
    return "\n".join(f"--- {app.url} log:\n{app.log_tail()}" for app in apps)
