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

A result is stored as JSON in ``response_body`` with ``response_status``
200 and a ``Content-Type: application/json`` header. Only what survives a
JSON round trip unchanged is accepted (tuples come back as lists); anything
else raises ``TypeError`` and the work is rolled back and its claim released.

One module per surface: ``errors``, ``results`` (identities, JSON, derived
keys), ``manual`` (claim by hand), ``lookups``, ``blocks`` (``once``),
``tasks`` (``@idempotent_task``, sync or async), ``aio`` (``aonce`` and the
async by-hand calls). Every public name is importable from here, except
``enqueue`` (``enqueue_once`` for django.tasks), which imports its task
framework and so is imported only where one is installed.
"""

from __future__ import annotations

from idempotency_app.exceptions import (
    ClaimLost,
    KeyInProgress,
    KeyReused,
    OutcomeUnknown,
    StoreUnavailable,
    WorkRolledBack,
)
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
from idempotency_app.service.lookups import LOOKUP_BATCH, Entry, lookup, lookup_many
from idempotency_app.service.manual import (
    Done,
    Held,
    claim,
    complete,
    complete_many,
    release,
    renew,
)
from idempotency_app.service.results import (
    RESULT_HEADERS,
    RESULT_STATUS,
    decode,
    derive_key,
    encode,
    make_identity,
)
from idempotency_app.service.tasks import idempotent_task

__all__ = [
    "LOOKUP_BATCH",
    "RESULT_HEADERS",
    "RESULT_STATUS",
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
    "decode",
    "derive_key",
    "encode",
    "idempotent_task",
    "lookup",
    "lookup_many",
    "make_identity",
    "once",
    "release",
    "renew",
]
