"""Idempotency for work that is not an HTTP view: tasks, webhooks, consumers.

Queues, brokers and webhook senders deliver at least once. The same claim,
lease, fencing and replay as the DRF integration make each delivery of one
(scope, key) run its work once; every copy gets the same result.

- ``@idempotent_task(key=..., scope=...)`` wraps a task or handler function.
- ``with once(scope, key, operation) as run:`` guards a block of code.
- ``claim`` / ``complete`` / ``release`` / ``renew`` drive it by hand;
  ``lookup`` / ``lookup_many`` read what is stored; ``complete_many``
  completes a batch in one transaction.
- ``derive_key`` makes a stable key for a downstream API from ours.

A result is stored as JSON in ``response_body``, with no response status.
Only what survives a JSON round trip unchanged is accepted (tuples come back
as lists); anything else raises ``TypeError`` and the work is rolled back and
its claim released.

One module per surface: ``results`` (identities, JSON, derived keys),
``manual`` (claim by hand), ``lookups``, ``blocks`` (``once``),
``tasks`` (``@idempotent_task``, sync or async), ``aio`` (``aonce`` and the
async by-hand calls). Every public name is importable from here, except
``enqueue`` (``enqueue_once`` for django.tasks), which imports its task
framework and so is imported only where one is installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from idempotency_app._moved import deprecated
from idempotency_app.exceptions import (
    ClaimLost,
    KeyInProgress,
    KeyReused,
    OutcomeUnknown,
    StoreUnavailable,
    WorkRolledBack,
)
from idempotency_app.lifecycle.claims import derive_key
from idempotency_app.service.aio import (
    aclaim,
    acomplete,
    acomplete_many,
    alookup,
    alookup_many,
    aonce,
    arelease,
    arenew,
)
from idempotency_app.service.blocks import Run, once
from idempotency_app.service.lookups import Entry, lookup, lookup_many
from idempotency_app.service.manual import (
    Done,
    Held,
    claim,
    complete,
    complete_many,
    release,
    renew,
)
from idempotency_app.service.tasks import idempotent_task

__all__ = [
    "ClaimLost",
    "Done",
    "Entry",
    "Held",
    "KeyInProgress",
    "KeyReused",
    "OutcomeUnknown",
    "Run",
    "StoreUnavailable",
    "WorkRolledBack",
    "aclaim",
    "acomplete",
    "acomplete_many",
    "alookup",
    "alookup_many",
    "aonce",
    "arelease",
    "arenew",
    "claim",
    "complete",
    "complete_many",
    "derive_key",
    "idempotent_task",
    "lookup",
    "lookup_many",
    "once",
    "release",
    "renew",
]


# Names that were public here before 0.2, and the modules that hold them now.
_MOVED = {
    "LOOKUP_BATCH": "idempotency_app.service.lookups",
    "RESULT_HEADERS": "idempotency_app.service.results",
    "RESULT_STATUS": "idempotency_app.service.results",
    "decode": "idempotency_app.service.results",
    "encode": "idempotency_app.service.results",
    "make_identity": "idempotency_app.service.results",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'idempotency_app.service' has no attribute {name!r}")
    deprecated(f"idempotency_app.service.{name}", f"{module}.{name} (internal)")
    if name in ("RESULT_STATUS", "RESULT_HEADERS"):
        from idempotency_app.service.results import LEGACY_RESULT

        return LEGACY_RESULT[0] if name == "RESULT_STATUS" else LEGACY_RESULT[1]
    return getattr(importlib.import_module(module), name)
