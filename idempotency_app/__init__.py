"""Idempotency keys for Django REST Framework.

Everything an integrator needs imports from here. The names load on first
use, so ``import idempotency_app`` is safe before Django's apps are ready
(in settings, say); everything not listed in ``__all__`` is internal.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from idempotency_app import _moved

__version__ = "0.1.0"
_moved.install()

# Each public name, and the module it lives in.
_PUBLIC = {
    # DRF views
    "idempotent": "idempotency_app.decorators",
    "IdempotentMixin": "idempotency_app.mixins",
    # tasks, webhooks and consumers
    "once": "idempotency_app.service",
    "aonce": "idempotency_app.service",
    "idempotent_task": "idempotency_app.service",
    "claim": "idempotency_app.service",
    "complete": "idempotency_app.service",
    "complete_many": "idempotency_app.service",
    "release": "idempotency_app.service",
    "renew": "idempotency_app.service",
    "lookup": "idempotency_app.service",
    "lookup_many": "idempotency_app.service",
    "aclaim": "idempotency_app.service",
    "acomplete": "idempotency_app.service",
    "acomplete_many": "idempotency_app.service",
    "arelease": "idempotency_app.service",
    "arenew": "idempotency_app.service",
    "alookup": "idempotency_app.service",
    "alookup_many": "idempotency_app.service",
    "derive_key": "idempotency_app.service",
    "enqueue_once": "idempotency_app.service.enqueue",
    "aenqueue_once": "idempotency_app.service.enqueue",
    "Run": "idempotency_app.service",
    "Held": "idempotency_app.service",
    "Done": "idempotency_app.service",
    "Entry": "idempotency_app.service",
    # errors
    "Error": "idempotency_app.exceptions",
    "IdempotencyError": "idempotency_app.exceptions",
    "IdempotencyKeyMissing": "idempotency_app.exceptions",
    "IdempotencyKeyInvalid": "idempotency_app.exceptions",
    "IdempotencyScopeMissing": "idempotency_app.exceptions",
    "RequestInProgress": "idempotency_app.exceptions",
    "IdempotencyKeyReused": "idempotency_app.exceptions",
    "ReplayNotAcceptable": "idempotency_app.exceptions",
    "RequestRolledBack": "idempotency_app.exceptions",
    "RequestOutcomeUnknown": "idempotency_app.exceptions",
    "IdempotencyStoreUnavailable": "idempotency_app.exceptions",
    "StoreUnavailable": "idempotency_app.exceptions",
    "OutcomeUnknown": "idempotency_app.exceptions",
    "CannotBeAtomic": "idempotency_app.exceptions",
    "TransactionEnded": "idempotency_app.exceptions",
    "InvalidKey": "idempotency_app.exceptions",
    "UnstorableIdentity": "idempotency_app.exceptions",
    "KeyInProgress": "idempotency_app.exceptions",
    "ClaimLost": "idempotency_app.exceptions",
    "WorkRolledBack": "idempotency_app.exceptions",
    "KeyReused": "idempotency_app.exceptions",
    # operations and tests
    "probe": "idempotency_app.probe",
    "assert_idempotent": "idempotency_app.testing",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'idempotency_app' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # the same names, typed, for type checkers and editors
    from idempotency_app.decorators import idempotent as idempotent
    from idempotency_app.exceptions import (
        CannotBeAtomic as CannotBeAtomic,
        ClaimLost as ClaimLost,
        Error as Error,
        IdempotencyError as IdempotencyError,
        IdempotencyKeyInvalid as IdempotencyKeyInvalid,
        IdempotencyKeyMissing as IdempotencyKeyMissing,
        IdempotencyKeyReused as IdempotencyKeyReused,
        IdempotencyScopeMissing as IdempotencyScopeMissing,
        IdempotencyStoreUnavailable as IdempotencyStoreUnavailable,
        InvalidKey as InvalidKey,
        KeyInProgress as KeyInProgress,
        KeyReused as KeyReused,
        OutcomeUnknown as OutcomeUnknown,
        ReplayNotAcceptable as ReplayNotAcceptable,
        RequestInProgress as RequestInProgress,
        RequestOutcomeUnknown as RequestOutcomeUnknown,
        RequestRolledBack as RequestRolledBack,
        StoreUnavailable as StoreUnavailable,
        TransactionEnded as TransactionEnded,
        UnstorableIdentity as UnstorableIdentity,
        WorkRolledBack as WorkRolledBack,
    )
    from idempotency_app.mixins import IdempotentMixin as IdempotentMixin
    from idempotency_app.probe import probe as probe
    from idempotency_app.service import (
        Done as Done,
        Entry as Entry,
        Held as Held,
        Run as Run,
        aclaim as aclaim,
        acomplete as acomplete,
        acomplete_many as acomplete_many,
        alookup as alookup,
        alookup_many as alookup_many,
        aonce as aonce,
        arelease as arelease,
        arenew as arenew,
        claim as claim,
        complete as complete,
        complete_many as complete_many,
        derive_key as derive_key,
        idempotent_task as idempotent_task,
        lookup as lookup,
        lookup_many as lookup_many,
        once as once,
        release as release,
        renew as renew,
    )
    from idempotency_app.service.enqueue import (
        aenqueue_once as aenqueue_once,
        enqueue_once as enqueue_once,
    )
    from idempotency_app.testing import assert_idempotent as assert_idempotent
