"""Every exception the library raises, under one root: ``Error``.

``except idempotency_app.Error`` catches them all. Each also keeps the base
it always had, so existing ``except`` clauses still work:

- the answers to HTTP clients are DRF ``APIException`` subclasses with
  stable codes (``IdempotencyError``), which a project's exception handler
  formats. With DRF's default handler each body is ``{"detail": ...,
  "code": ...}``; ``exc.default_code`` / ``exc.get_codes()`` carry the code
  for handlers that build their own shape, and ``IDEMPOTENCY["ERROR_FORMAT"]``
  changes the shape (see ``idempotency_app.problems``);
- the service API's (``KeyInProgress``, ``KeyReused``, ...) say what a task
  or consumer should do next;
- ``CannotBeAtomic`` (a ``RuntimeError``) stops work that could not commit
  with its outcome, naming the fix; ``InvalidKey`` and ``UnstorableIdentity``
  (``ValueError``) refuse what cannot identify a request.
"""

from __future__ import annotations

from typing import Any

from rest_framework import status
from rest_framework.exceptions import APIException

from idempotency_app.conf import conf


class Error(Exception):
    """The root of every exception the library raises."""


class IdempotencyError(Error, APIException):
    """An answer to an HTTP client, with a stable code."""

    def __init__(self, detail: str | None = None, code: str | None = None) -> None:
        self.code: str = code or str(self.default_code)
        self.message: str = detail or str(self.default_detail)
        if conf.ERROR_FORMAT == "handler":
            # A plain detail, like DRF's own exceptions: the handler shapes it.
            super().__init__(self.message, self.code)
        else:
            super().__init__({"detail": self.message, "code": self.code}, self.code)


class IdempotencyKeyMissing(IdempotencyError):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_key_missing"
    default_detail = (
        "This endpoint requires an Idempotency-Key header. Send a unique value "
        "(a UUID) and reuse it on every retry of the same request."
    )


class IdempotencyKeyInvalid(IdempotencyError):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_key_invalid"
    default_detail = (
        "The Idempotency-Key header must be 1 to 255 printable ASCII characters. "
        "Send a new key such as a UUID."
    )


class IdempotencyScopeMissing(IdempotencyError):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "idempotency_scope_missing"
    default_detail = (
        "Idempotency keys are only accepted from authenticated clients. "
        "Authenticate, or send the request without an Idempotency-Key header."
    )


class RequestInProgress(IdempotencyError):
    status_code = status.HTTP_409_CONFLICT
    default_code = "request_in_progress"
    default_detail = (
        "A request with this Idempotency-Key is still being processed. "
        "Retry after the delay in Retry-After to receive its result."
    )

    def __init__(self, retry_after: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait = retry_after


class IdempotencyKeyReused(IdempotencyError):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_code = "idempotency_key_reused"
    default_detail = (
        "This Idempotency-Key was already used for a different request. "
        "Use a new key for a new request; reuse a key only to retry the identical request."
    )


class ReplayNotAcceptable(IdempotencyError):
    status_code = status.HTTP_406_NOT_ACCEPTABLE
    default_code = "idempotency_replay_not_acceptable"
    default_detail = (
        "The response stored for this Idempotency-Key has a media type that this "
        "request's Accept header does not allow. The request was not run again: retry "
        "with an Accept header that allows the stored media type."
    )


class RequestRolledBack(IdempotencyError):
    status_code = status.HTTP_500_INTERNAL_SERVER_ERROR
    default_code = "request_rolled_back"
    default_detail = (
        "This request's work was rolled back, so nothing was done. "
        "Retry with the same Idempotency-Key."
    )


class RequestOutcomeUnknown(IdempotencyError):
    status_code = status.HTTP_500_INTERNAL_SERVER_ERROR
    default_code = "request_outcome_unknown"
    default_detail = (
        "This request was interrupted after part of its work may have been saved, so it "
        "will not run again with this Idempotency-Key: every retry gets this answer. "
        "Check whether the work happened (look the resource up) before sending it again "
        "with a new key; an operator can release the key to let it run again."
    )


class IdempotencyStoreUnavailable(IdempotencyError):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "idempotency_store_unavailable"
    default_detail = (
        "The database could not record this request's Idempotency-Key or its outcome. "
        "Retry later with the same key: you get the stored result if the request "
        "completed, and it runs once if it did not."
    )

    def __init__(self, retry_after: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait = retry_after


# -- the lifecycle -----------------------------------------------------------


class StoreUnavailable(Error):
    """The database could not record the key or the outcome. Nothing was
    stored: a retry with the same key replays the outcome if it committed
    after all, and runs the work once if it did not."""


class OutcomeUnknown(Error):
    """The work under this key ended its own transaction part-way (or did
    something else the library cannot undo), so whether any of it committed
    is unknown. The key keeps that answer: it is never run again by itself,
    until an operator releases it or it expires."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"The work on idempotency key {key!r} was interrupted after part of it may have "
            "committed, so it will not run again with this key. Check what it did, then "
            "release the key in the admin (or use a new key) to run it again."
        )
        self.key = key


class CannotBeAtomic(Error, RuntimeError):
    """The work did something that cannot commit together with its stored
    outcome; it was stopped and rolled back. The message names the fix."""


class TransactionEnded(CannotBeAtomic):
    """The work's transaction ended while the work ran, so part of the work
    may have committed: it must never run again by itself."""


class InvalidKey(Error, ValueError):
    """The header is present but unusable; the message says why."""


class UnstorableIdentity(Error, ValueError):
    """The scope, key or operation cannot be stored exactly on this connection."""


# -- the service API ---------------------------------------------------------


class KeyInProgress(Error):
    """Another worker holds the key: retry later (a queue's retry fits)."""

    def __init__(self, key: str, retry_after: int = 1) -> None:
        super().__init__(
            f"Idempotency key {key!r} is being processed by another worker; "
            f"retry in {retry_after}s or more to get its result."
        )
        self.key = key
        self.retry_after = retry_after


class ClaimLost(KeyInProgress):
    """Our lease ran out and another worker took the key over; our work was
    rolled back, and a retry gets the new owner's result."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.args = (
            f"The claim on idempotency key {key!r} was taken over after its lease "
            "ran out; this worker's work was rolled back. Raise the lease above "
            "the slowest run, or call renew() while working.",
        )


class WorkRolledBack(Error):
    """The work's transaction was marked for rollback (a caught database
    error, ``set_rollback(True)``) or failed to commit: nothing it did was
    kept, no result was stored and the key was released, so a retry runs
    the work again."""

    def __init__(self, key: str, value: Any = None) -> None:
        super().__init__(
            f"The work on idempotency key {key!r} was rolled back, so nothing was stored; "
            "a retry runs it again. Wrap a statement whose database error you catch in its "
            "own transaction.atomic()."
        )
        self.key = key
        # What the work returned (a view's response), which did not commit.
        self.value = value


class KeyReused(Error):
    """The key was already used for another operation or fingerprint."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"Idempotency key {key!r} was already used for a different operation "
            "or fingerprint; use a new key for different work."
        )
        self.key = key
