"""``store.base.Judgements`` is shared by every thread of a process (a
gunicorn worker with threads). A thread switch while one thread stores
what it judged (the GIL may switch between any two bytecodes) must
neither leave a set without its answer (an IndexError out of the claim:
a 500 on a process's first concurrent requests) nor pair one set with
another's answer (a set with an agent on a cursor's way judged
agent-free for the life of the process). When the answers were two
lists appended one after the other, both happened.

The switch is forced here, with a trace function, at the line that
stores an answer, so the interleaving is deterministic."""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any

from idempotency_app.store import base

SOURCE, FIRST = inspect.getsourcelines(base.Judgements.judge)
STORE = FIRST + next(i for i, line in enumerate(SOURCE) if "self.known = " in line)


def _paused_while_storing(judgements: base.Judgements, key: Any) -> tuple[Any, Any, Any]:
    """Start a thread judging ``key``; return once it is about to store
    its answer, with the event that lets it go on."""
    at_gap, go_on = threading.Event(), threading.Event()
    out: list[Any] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is base.Judgements.judge.__code__:

            def local(frame: Any, event: str, arg: Any) -> Any:
                if event == "line" and frame.f_lineno == STORE:
                    at_gap.set()
                    go_on.wait(10)
                return local

            return local
        return None

    def run() -> None:
        sys.settrace(tracer)
        try:
            out.append(judgements.judge(key, key))
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=run)
    thread.start()
    assert at_gap.wait(10)
    return thread, go_on, out


def test_a_key_found_before_its_answer_is_stored_does_not_crash() -> None:
    judgements = base.Judgements(lambda functions: True)
    key = (len, abs, "code")
    thread, go_on, out = _paused_while_storing(judgements, key)
    try:
        answer = judgements.judge(key, key)  # another request's thread, at the same time
    finally:
        go_on.set()
        thread.join()
    assert answer is True
    assert out == [True]


def test_two_sets_judged_at_once_keep_their_own_answers() -> None:
    agent = ("an agent's function",)
    plain = ("Django's function",)
    judgements = base.Judgements(lambda functions: functions is plain)
    thread, go_on, out = _paused_while_storing(judgements, agent)  # judged False, not stored
    try:
        assert judgements.judge(plain, plain) is True
    finally:
        go_on.set()
        thread.join()
    assert out == [False]
    # Asked again later (the process's next request with the agent in place).
    assert judgements.judge(agent, agent) is False
    assert judgements.judge(plain, plain) is True
