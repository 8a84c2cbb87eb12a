"""Tools that keep state per transaction (django-cachalot's
``_patch_atomic``, django-cacheops' ``AtomicMixIn`` via
``monkey_mix(Atomic, ...)``) patch ``Atomic.__enter__`` and
``Atomic.__exit__`` on Django's class: an invalidation made inside a block
is held until that block's exit, and only the outermost block's committing
exit publishes it. The unit's block must be entered and left through them:
an exit of its own that skipped ``Atomic.__exit__`` (tried once, to save
Django's commit() where the COMMIT went with the completion) left such a
tool's state growing per request and the work's writes never published."""

from __future__ import annotations

import functools
import uuid
from typing import Any

import pytest
from django.db import connections
from django.db.transaction import Atomic

from idempotency_app import service
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True)]

SCOPE = "tests:patched-atomic"


class _CachalotLike:
    """As django-cachalot's ``_patch_atomic``: one pending-invalidations
    frame per open block, published on the outermost committing exit."""

    def __init__(self) -> None:
        self.frames: list[list[str]] = []
        self.published: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        enter, exit_ = Atomic.__enter__, Atomic.__exit__

        @functools.wraps(enter)
        def patched_enter(block: Any) -> Any:
            self.frames.append([])
            return enter(block)

        @functools.wraps(exit_)
        def patched_exit(block: Any, exc_type: Any, exc: Any, tb: Any) -> Any:
            needs_rollback = connections[block.using].needs_rollback
            try:
                return exit_(block, exc_type, exc, tb)
            finally:
                frame = self.frames.pop()
                if exc_type is None and not needs_rollback:
                    if self.frames:
                        self.frames[-1].extend(frame)
                    else:
                        self.published.extend(frame)

        monkeypatch.setattr(Atomic, "__enter__", patched_enter)
        monkeypatch.setattr(Atomic, "__exit__", patched_exit)

    def invalidate(self, table: str) -> None:
        if self.frames:
            self.frames[-1].append(table)
        else:
            self.published.append(table)


def test_a_patched_atomic_exit_sees_the_unit_s_block_end(monkeypatch: pytest.MonkeyPatch) -> None:
    tool = _CachalotLike()
    tool.install(monkeypatch)
    with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
        if run.should_execute:
            Charge.objects.create(label="written")
            tool.invalidate("testapp_charge")
            run.result = "done"
    assert run.result == "done"
    assert list(Charge.objects.values_list("label", flat=True)) == ["written"]
    # Every block entered was left, and the committed write was published.
    assert tool.frames == []
    assert tool.published == ["testapp_charge"]


def test_units_leave_no_per_transaction_state_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tool = _CachalotLike()
    tool.install(monkeypatch)
    for _ in range(3):
        with service.once(SCOPE, str(uuid.uuid4()), "op") as run:
            if run.should_execute:
                Charge.objects.create(label="x")
                run.result = "done"
    assert tool.frames == []
