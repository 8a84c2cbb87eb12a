"""Completed responses kept in this process for ``REPLAY_CACHE`` seconds, so
that a retry of a key this process completed or replayed a moment ago is
answered without reaching the database (off by default).

What it trades: for up to ``REPLAY_CACHE`` seconds a process may replay a
record that has changed in the database since it read it. Completed
records change only when an operator expires or deletes them in the admin
(or the sweep deletes them once expired); the admin's actions empty this
process's cache at once, but every other process keeps replaying what it
holds until its entry is ``REPLAY_CACHE`` seconds old. A request that does
not match what is held (another operation or fingerprint) always asks the
database, which answers 422 or whatever is true there.

Bounded: at most ``REPLAY_CACHE_ENTRIES`` responses, the oldest dropped
first, and none whose body is over ``MAX_ENTRY_BYTES``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from django.db import transaction

from idempotency_app.conf import conf
from idempotency_app.store import Identity, StoredResponse

MAX_ENTRY_BYTES = 64 * 1024

# (alias, scope, key) -> (monotonic deadline, operation, fingerprint, response)
_Entry = tuple[float, str, str, StoredResponse]
_entries: OrderedDict[tuple[str, str, str], _Entry] = OrderedDict()
_lock = threading.Lock()


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


def put(identity: Identity, using: str, response: StoredResponse) -> None:
    """Hold ``response`` (completed, committed) for ``REPLAY_CACHE`` seconds."""
    seconds = conf.REPLAY_CACHE
    if seconds <= 0:
        return
    if len(response.body or b"") > MAX_ENTRY_BYTES:
        forget(using, identity)  # nor what was held before it
        return
    entry = (time.monotonic() + seconds, identity.operation, identity.fingerprint, response)
    limit = conf.REPLAY_CACHE_ENTRIES
    with _lock:
        _entries.pop((using, identity.scope, identity.key), None)  # to the newest end
        _entries[(using, identity.scope, identity.key)] = entry
        while len(_entries) > limit:
            _entries.popitem(last=False)


def forget(using: str, identity: Identity) -> None:
    with _lock:
        _entries.pop((using, identity.scope, identity.key), None)


def clear() -> None:
    """Forget everything: an operator changed records this process may hold."""
    with _lock:
        _entries.clear()


def clear_on_commit(using: str) -> None:
    """Forget everything once an operator's change on ``using`` commits (at
    once outside a transaction): cleared earlier, a replay in between could
    bring the old record back."""
    transaction.on_commit(clear, using=using)
