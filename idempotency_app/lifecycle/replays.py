"""Completed responses kept in this process for ``REPLAY_CACHE`` seconds, so
that a retry of a key this process completed or replayed a moment ago is
answered without reaching the database (off by default).

What it trades: for up to ``REPLAY_CACHE`` seconds a process may replay a
record that has changed in the database since it read it. A completed
record changes when an operator expires or releases it in the admin, and
when its ``TTL`` ends. Only committed records are held, never one read
inside a transaction; none past its own expiry (a record that expires
within ``MAX_REPLAY_CACHE`` seconds of being read is not held); and the
admin's actions empty this process's cache once they commit, counting a
replay read before that as stale. Every other process keeps replaying what
it holds until its entry is ``REPLAY_CACHE`` seconds old. A request that
does not match what is held (another operation or fingerprint) always asks
the database, which answers 422 or whatever is true there.

Bounded: at most ``REPLAY_CACHE_ENTRIES`` responses, the oldest dropped
first, and none over ``MAX_ENTRY_BYTES`` (body and headers). A change of
the ``IDEMPOTENCY`` setting (``override_settings`` in a test) empties it:
what was held under the old settings, or while the cache was on, is never
replayed under the new ones. So does ``flush``, which tests that commit
run between tests (it sends ``post_migrate``, or, in a test case with
``available_apps``, the test case changes ``INSTALLED_APPS`` around it):
the database forgets every key then, and so must this process. Django's
flush for ``serialized_rollback`` sends nothing: such tests turn the cache
off (docs/performance.md).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from django.core.signals import setting_changed
from django.db import transaction
from django.db.models.signals import post_migrate

from idempotency_app.conf import conf
from idempotency_app.store import Identity, StoredResponse

MAX_ENTRY_BYTES = 64 * 1024

# (alias, scope, key) -> (monotonic deadline, operation, fingerprint, response)
_Entry = tuple[float, str, str, StoredResponse]
_entries: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
_lock = threading.Lock()
# Moves on at every clear(): a response read before it is not put after it.
_generation = 0


def get(identity: Identity, using: str) -> StoredResponse | None:
    """The response held for ``identity``, if it is fresh and the request
    matches the one that was stored."""
    entry = _entries.get((using, identity.scope, identity.key))
    if entry is None:
        return None
    deadline, operation, fingerprint, response = entry
    if deadline <= time.monotonic():
        forget(using, identity)
        return None
    if operation != identity.operation or fingerprint != identity.fingerprint:
        return None  # the database decides (a 422, or a record replaced since)
    return response


def generation() -> int:
    """Take this before reading a response that may be put."""
    return _generation


def put(
    identity: Identity, using: str, response: StoredResponse, since: int, ttl: float | None = None
) -> None:
    """Hold ``response`` (completed and committed, read or stored after
    ``generation()`` returned ``since``) for ``REPLAY_CACHE`` seconds, or
    until ``ttl`` seconds from now if sooner."""
    seconds = conf.REPLAY_CACHE
    if ttl is not None:
        seconds = min(seconds, ttl)
    if seconds <= 0:
        return
    size = len(response.body or b"") + sum(len(k) + len(v) for k, v in response.headers)
    item = (using, identity.scope, identity.key)
    with _lock:
        _entries.pop(item, None)  # to the newest end, or gone if not held again
        if since != _generation or size > MAX_ENTRY_BYTES:
            return
        _entries[item] = (
            time.monotonic() + seconds,
            identity.operation,
            identity.fingerprint,
            response,
        )
        while len(_entries) > conf.REPLAY_CACHE_ENTRIES:
            _entries.popitem(last=False)


def forget(using: str, identity: Identity) -> None:
    with _lock:
        _entries.pop((using, identity.scope, identity.key), None)


def clear() -> None:
    """Forget everything: an operator changed records this process may
    hold, or the settings changed."""
    global _generation
    with _lock:
        _generation += 1
        _entries.clear()


def clear_on_commit(using: str) -> None:
    """Forget everything once an operator's change on ``using`` commits (at
    once outside a transaction)."""
    transaction.on_commit(clear, using=using)


def _clear_on_change(setting: str, **kwargs: object) -> None:
    # INSTALLED_APPS: a TransactionTestCase with available_apps flushes
    # without post_migrate, and names it as it sets up and tears down.
    if setting in ("IDEMPOTENCY", "INSTALLED_APPS"):
        clear()


def _clear_after_migrate(**kwargs: object) -> None:
    clear()


setting_changed.connect(_clear_on_change, dispatch_uid="idempotency_app.replays")
post_migrate.connect(_clear_after_migrate, dispatch_uid="idempotency_app.replays")
