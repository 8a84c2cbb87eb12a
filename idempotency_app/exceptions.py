"""DRF exceptions with stable codes; a project's exception handler formats them.

With DRF's default handler each body is ``{"detail": ..., "code": ...}``,
and ``exc.default_code`` / ``exc.get_codes()`` carry the code for handlers
that build their own shape. ``IDEMPOTENCY["ERROR_FORMAT"]`` changes the
shape (see ``idempotency_app.problems``).
"""

from __future__ import annotations

from typing import Any

from rest_framework import status
from rest_framework.exceptions import APIException

from idempotency_app.conf import conf


class IdempotencyError(APIException):
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
