"""Two app servers whose clocks differ by five minutes.

"No takeover of a live claim."

Both serve the same private database with ``LEASE`` 60 and ``TTL`` 120;
one runs under Debian's libfaketime with its wall clock 5 minutes ahead
(``app_server(..., faketime="+5m")``). By its own clock, every lease the
other server grants has lapsed and every record it completes has expired.
Leases and expiry are judged by the database's clock, so:

a. a slow request on the normal server; while it runs, the same key and
   body on the fast server gets 409, and after it the fast server replays;
b. a key completed on the normal server is replayed by the fast one, not
   run again (by the fast clock it is past its 120 s TTL);
c. and d. the same, the other way round: a claim made, and a key completed,
   by the fast server are not taken over by the normal one.
Each key's work ran once: one Charge, one LedgerEntry.
"""

from __future__ import annotations

import email.utils
import json
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from tests import servers
from tests.faults import harness as faults

pytestmark = faults.MARKS

SKEW = 300.0  # seconds: faketime "+5m"
SLOW = 4.0  # seconds the view sleeps while the other server tries the key


@pytest.mark.parametrize("vendor", ["postgres", "mariadb"])
def test_skewed_app_servers_take_over_no_live_claim(
    vendor: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with faults.private_database(vendor) as db:
        servers.prepare_database(db.settings_env())
        env = {
            **db.settings_env(),
            "IDEMPOTENCY_TEST_SERVER_IDEMPOTENCY": json.dumps({"LEASE": 60, "TTL": 120}),
        }
        with servers.app_server(env) as normal, servers.app_server(env, faketime="+5m") as fast:
            answers: list[faults.Answer] = []

            def send(app: servers.AppServer, key: str, body: dict[str, object]) -> faults.Answer:
                answer = faults.send(app.url, "/charges/", body, key)
                answers.append(answer)
                return answer

            skew = _skew(send(fast, str(uuid.uuid4()), _body("probe")))
            assert abs(skew - SKEW) < 60, f"the fast server's clock is {skew:.0f} s ahead"
            problems: list[str] = []
            scenarios = {
                "a": _live_claim(send, db, problems, owner=normal, other=fast),
                "b": _completed_key(send, problems, owner=normal, other=fast),
                "c": _live_claim(send, db, problems, owner=fast, other=normal),
                "d": _completed_key(send, problems, owner=fast, other=normal),
            }
            logs = normal.log.read_text(errors="replace") + fast.log.read_text(errors="replace")
        committed = faults.Committed.read(db)

    for name, (label, first) in scenarios.items():
        rows = committed.charges.get(label, [])
        if [(c.id, c.ledger_entries) for c in rows] != [(first.json()["id"], 1)]:
            problems.append(f"{name}: {label} committed {rows}, the first 2xx was {first.body!r}")
    takeovers = logs.count("Took over")
    faults.report(
        capsys,
        f"clock-skew-{vendor}",
        f"fast server's clock {skew:+.0f} s (its Date header)",
        "a/c: a live claim met from the other server, b/d: a completed key "
        "retried on the other server, both directions",
        faults.summary(answers),
        faults.latency(answers),
        faults.executions(committed, [label for label, _ in scenarios.values()], "key"),
        f"takeovers logged {takeovers}",
        f"problems {len(problems)}",
    )
    faults.assert_no_problems(problems, "answers that show a live claim taken over")
    assert not takeovers, logs[-3000:]


def _body(name: str, **extra: object) -> dict[str, object]:
    return {"label": f"clock-{name}-{uuid.uuid4().hex[:8]}", "amount": 1, **extra}


def _skew(answer: faults.Answer) -> float:
    """How far ahead of ours the server's clock is, by its Date header."""
    assert answer.status == 201, answer.describe()
    served = email.utils.parsedate_to_datetime(answer.date).timestamp()
    return served - time.time()


Send = Callable[[servers.AppServer, str, dict[str, object]], faults.Answer]


def _live_claim(
    send: Send,
    db: faults.PrivateDatabase,
    problems: list[str],
    owner: servers.AppServer,
    other: servers.AppServer,
) -> tuple[str, faults.Answer]:
    """A slow request on ``owner``; the same key and body on ``other``
    while it runs must get 409; after it, ``other`` replays it."""
    key, body = str(uuid.uuid4()), _body("live", sleep=SLOW)
    result: list[faults.Answer] = []
    slow = threading.Thread(target=lambda: result.append(send(owner, key, body)), daemon=True)
    slow.start()
    try:
        faults.wait_until(
            lambda: (faults.claim_state(db, key) or ("",))[0] == "in_progress",
            "the slow request's claim",
        )
        duplicate = send(other, key, body)
    finally:
        slow.join(timeout=60)
    assert result, "the slow request did not end"
    first = result[0]
    if (duplicate.status, duplicate.code) != (409, "request_in_progress"):
        problems.append(
            f"{_name(other)} took over a live claim of {_name(owner)}: "
            f"{duplicate.describe()} {duplicate.body!r}"
        )
    if first.status != 201 or first.replayed:
        problems.append(f"the slow request on {_name(owner)} got {first.describe()}")
    after = send(other, key, body)
    if not after.replayed or (after.status, after.body) != (first.status, first.body):
        problems.append(f"then {_name(other)} answered {after.describe()}, not the replay")
    winner = first if first.ok else duplicate
    return str(body["label"]), winner


def _completed_key(
    send: Send, problems: list[str], owner: servers.AppServer, other: servers.AppServer
) -> tuple[str, faults.Answer]:
    """A key completed on ``owner`` is replayed by ``other``, never run again."""
    key, body = str(uuid.uuid4()), _body("done")
    first = send(owner, key, body)
    assert first.status == 201 and not first.replayed, first.describe()
    again = send(other, key, body)
    if not again.replayed or (again.status, again.body) != (201, first.body):
        problems.append(
            f"{_name(other)} ran a key {_name(owner)} completed again: "
            f"{again.describe()} {again.body!r}"
        )
    return str(body["label"]), first


def _name(app: servers.AppServer) -> str:
    return "the fast server" if "FAKETIME" in app.env else "the normal server"
