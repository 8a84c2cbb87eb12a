"""Redis, which holds the retry-storm guard, killed and restarted under load.

"No 5xx, one execution per key, bounded latency."

A private PostgreSQL for the records and a private Redis for the guard
(tests/settings.py then uses django-redis with 0.2 s socket timeouts), one
gunicorn with two workers. Client threads send two kinds of intents:
- a valid charge, sent three times (the first runs, the others replay);
- an invalid one (the view raises a ValidationError: 400, which is released
  and cached in Redis), sent three times, then corrected (a valid body, the
  same key) and sent twice: the correction runs once, its retry replays.
The clients keep going while, on a timetable, Redis is up for 2 s, SIGKILLed
for 2 s and started again (empty: no persistence), up for 7 s, frozen with
SIGSTOP for 2 s (every call to it then waits for the socket timeout) and
thawed, and up for 7 s more. The guard fails open: a request never fails
because of Redis, and a dead Redis costs at most one timeout per
``CACHE_RETRY_INTERVAL`` (5 s) per process. After each fault the guard
answers again (7 s is more than that interval).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from tests import servers
from tests.faults import harness as faults

pytestmark = faults.MARKS

CLIENTS = 4
UP_FOR = 2.0  # seconds of load with Redis up, before and after each fault
DOWN_FOR = 2.0  # seconds Redis is dead, then frozen
CACHE_RETRY_INTERVAL = 5  # the default: how long the guard stays off after an error
VALIDATION_BODY = b'{"amount":["Must be positive."]}'
INVALID = "-invalid-first"  # the label's ending for intents first sent invalid


def _client(load: faults.Load, intent: faults.Intent) -> None:
    """An invalid intent is sent as is three times, then corrected; every
    intent's valid body is then sent until it has a 2xx, and once more."""
    invalid = intent.label.endswith(INVALID)
    if invalid:
        bad = {**intent.body, "raise": "validation"}
        for _ in range(3):
            answer = faults.send(load.url, load.path, bad, intent.key, timeout=load.timeout)
            intent.answers.append(dataclasses.replace(answer, tag="invalid"))
    for _ in range(2 if invalid else 3):
        answer = faults.send(load.url, load.path, intent.body, intent.key, timeout=load.timeout)
        intent.answers.append(dataclasses.replace(answer, tag="valid"))


def test_redis_killed_and_frozen_under_load(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("psycopg", reason="psycopg not installed: pip install -e '.[postgres]'")
    pytest.importorskip("redis", reason="redis-py not installed: pip install django-redis")
    # More than the clients can send in the scenario: they stop when it ends.
    intents = faults.make_intents("redis", CLIENTS, 2000)
    for mine in intents:
        for i, intent in enumerate(mine):
            if i % 2:
                intent.body["label"] += INVALID
    with servers.private_postgres() as pg, servers.private_redis() as redis:
        servers.prepare_database(pg.settings_env())
        env = {**pg.settings_env(), **redis.settings_env()}
        with servers.app_server(env, workers=2) as app:
            marks = {"start": time.monotonic()}
            frozen_pid = 0
            try:
                with faults.Load(app.url, intents, client=_client) as load:
                    time.sleep(UP_FOR)
                    marks["killed"] = time.monotonic()
                    redis.kill()
                    time.sleep(DOWN_FOR)
                    redis.start()
                    marks["restarted"] = time.monotonic()
                    time.sleep(UP_FOR + CACHE_RETRY_INTERVAL)
                    assert redis.process is not None
                    frozen_pid = redis.process.pid
                    marks["frozen"] = time.monotonic()
                    os.kill(frozen_pid, signal.SIGSTOP)
                    time.sleep(DOWN_FOR)
                    os.kill(frozen_pid, signal.SIGCONT)
                    frozen_pid = 0
                    marks["thawed"] = time.monotonic()
                    time.sleep(UP_FOR + CACHE_RETRY_INTERVAL)
                    load.stop.set()
                marks["end"] = time.monotonic()
            finally:
                if frozen_pid:
                    os.kill(frozen_pid, signal.SIGCONT)  # so that its stop can end it
                app_log = app.log_tail()
            committed = faults.Committed.read(pg)

    everyone = [intent for intent in load.all if intent.answers]
    answers = load.answers()
    problems = faults.check_intents(everyone, committed)
    for intent in everyone:
        for answer in intent.answers:
            expected = 400 if answer.tag == "invalid" else 201
            if answer.status != expected or (expected == 400 and answer.body != VALIDATION_BODY):
                problems.append(
                    f"{intent.label}: {answer.tag} request got {answer.describe()} "
                    f"{answer.body[:100]!r}"
                )
    total = sum(len(rows) for rows in committed.charges.values())
    if total != len(everyone):
        problems.append(f"{total} charges for {len(everyone)} intents")

    def phase(start: str, end: str) -> list[faults.Answer]:
        """The answers that came back in this phase: a request that waited
        on Redis counts where its wait ended."""
        return [a for a in answers if marks[start] <= a.started + a.latency < marks[end]]

    def guarded(among: list[faults.Answer]) -> int:
        return sum(a.replayed for a in among if a.tag == "invalid" and a.status == 400)

    spans = {
        "up": ("start", "killed"),
        "killed": ("killed", "restarted"),
        "restarted": ("restarted", "frozen"),
        "frozen": ("frozen", "thawed"),
        "thawed": ("thawed", "end"),
    }
    phases = {name: phase(*span) for name, span in spans.items()}
    invalid = [a for a in answers if a.tag == "invalid"]
    faults.report(
        capsys,
        "redis-kill",
        f"{len(everyone)} intents (half sent invalid 3x then corrected 2x, half valid 3x)",
        faults.summary(answers),
        f"{len(invalid)} invalid requests, {guarded(invalid)} answered by the guard",
        "by phase: "
        + "; ".join(
            f"{name} {marks[spans[name][1]] - marks[spans[name][0]]:.1f} s: {len(among)} "
            f"requests, {faults.outcomes(among)}, guard {guarded(among)}, "
            f"{faults.latency(among)}, {sum(a.latency >= 0.2 for a in among)} took 0.2 s or more"
            for name, among in phases.items()
        ),
        f"overall {faults.latency(answers)}",
        faults.executions(committed, [i.label for i in everyone]),
    )
    assert not [a for a in answers if a.status is None or a.status >= 500], (
        f"5xx or no answer while Redis failed: {faults.outcomes(answers)}\n{app_log}"
    )
    faults.assert_no_problems(problems, "answers that disagree with what committed")
    assert faults.percentile([a.latency for a in answers], 0.99) < 3.0, faults.latency(answers)
    assert all(phases.values()), "a phase of the scenario saw no request"
    # The guard works before the faults and again after each (fail-open is
    # a pause of CACHE_RETRY_INTERVAL, not for good).
    assert guarded(phases["up"]) and guarded(phases["restarted"]) and guarded(phases["thawed"])
