"""DRF exceptions with stable codes; a project's exception handler formats them.

With DRF's default handler each body is ``{"detail": ..., "code": ...}``,
and ``exc.default_code`` / ``exc.get_codes()`` carry the code for handlers
that build their own shape.
"""

from __future__ import annotations

from typing import Any

from rest_framework import status
from rest_framework.exceptions import APIException


class IdempotencyError(APIException):
    def __init__(self, detail: str | None = None, code: str | None = None) -> None:
        code = code or self.default_code
        super().__init__({"detail": detail or str(self.default_detail), "code": code}, code)


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


class IdempotencyStoreUnavailable(IdempotencyError):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_code = "idempotency_store_unavailable"
    default_detail = (
        "The request was not processed because its Idempotency-Key could not be "
        "recorded. Retry later with the same key."
    )

    def __init__(self, retry_after: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait = retry_after
