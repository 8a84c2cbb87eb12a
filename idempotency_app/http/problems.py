"""How the library's own errors reach the client: ``IDEMPOTENCY["ERROR_FORMAT"]``.

- ``"detail"`` (the default): the exception's detail is
  ``{"detail": "<what to do next>", "code": "<code>"}``, and the project's
  exception handler renders it (DRF's default handler sends it as it is).
- ``"problem"``: RFC 9457 problem details, answered by the library itself as
  ``application/problem+json`` with ``type``, ``title``, ``status``,
  ``detail`` and ``code``, whatever the project's exception handler, so a
  client of an API that speaks problem details everywhere gets them here too.
- ``"handler"``: the detail is a plain string with a code, like DRF's own
  exceptions, for exception handlers that build their own shape from
  ``exc.detail`` and its code (drf-standardized-errors: one error with
  ``attr`` null, rather than one error per key of the dict).

Each code has a stable ``type`` URI: ``PROBLEM_TYPE_BASE`` followed by the
code. The default base is a URN, an identifier that never breaks; a project
that publishes a page per error sets the base to that page's URL.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from django.http import HttpResponse
from rest_framework.views import set_rollback

from idempotency_app.conf import conf
from idempotency_app.exceptions import IdempotencyError

FORMATS = ("detail", "problem", "handler")
MEDIA_TYPE = "application/problem+json"
# Short, stable summaries of each problem type (RFC 9457 "title"); the
# "detail" says what this client should do next.
TITLES = {
    "idempotency_key_missing": "Idempotency-Key required",
    "idempotency_key_invalid": "Invalid Idempotency-Key",
    "idempotency_scope_missing": "Idempotency-Key needs an authenticated client",
    "request_in_progress": "Request in progress",
    "idempotency_key_reused": "Idempotency-Key reused",
    "idempotency_replay_not_acceptable": "Stored response not acceptable",
    "request_rolled_back": "Request rolled back",
    "request_outcome_unknown": "Request outcome unknown",
    "idempotency_store_unavailable": "Idempotency store unavailable",
}
STANDARDIZED_ERRORS_HANDLER = "drf_standardized_errors.handler.exception_handler"


def type_uri(code: str) -> str:
    return f"{conf.PROBLEM_TYPE_BASE}{code}"


def title(code: str, status: int) -> str:
    return TITLES.get(code) or HTTPStatus(status).phrase


def problem(exc: IdempotencyError) -> dict[str, Any]:
    """The problem details object for ``exc``."""
    return {
        "type": type_uri(exc.code),
        "title": title(exc.code, exc.status_code),
        "status": exc.status_code,
        "detail": exc.message,
        "code": exc.code,
    }


def respond(exc: IdempotencyError) -> HttpResponse:
    """The ``application/problem+json`` answer for ``exc``.

    It stands in for the project's exception handler, so it does what
    DRF's handler does for any exception: mark an ``ATOMIC_REQUESTS``
    transaction for rollback, and send ``Retry-After`` when the client
    should wait."""
    set_rollback()
    response = HttpResponse(
        json.dumps(problem(exc)), status=exc.status_code, content_type=MEDIA_TYPE
    )
    wait = getattr(exc, "wait", None)
    if wait:
        response["Retry-After"] = str(int(wait))
    return response


def is_standardized_errors(handler: Any) -> bool:
    """Whether ``handler`` is drf-standardized-errors' exception handler."""
    path = f"{getattr(handler, '__module__', '')}.{getattr(handler, '__qualname__', '')}"
    return path == STANDARDIZED_ERRORS_HANDLER
