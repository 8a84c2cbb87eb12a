"""ERROR_FORMAT: the default {"detail", "code"} body, RFC 9457 problem
details, and a plain detail for drf-standardized-errors; their checks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.test.utils import override_settings
from rest_framework.test import APIClient

from idempotency_app import checks
from idempotency_app.exceptions import KeyInProgress, RequestInProgress
from idempotency_app.http import problems
from idempotency_app.lifecycle import units
from tests.conftest import post

pytestmark = pytest.mark.django_db

STANDARDIZED = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.SessionAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "EXCEPTION_HANDLER": "drf_standardized_errors.handler.exception_handler",
}


def reused(api: APIClient, key: str, url: str = "/charges/") -> Any:
    assert post(api, url, {"amount": 1}, key).status_code == 201
    return post(api, url, {"amount": 2}, key)


@pytest.fixture
def in_progress(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every claim finds the key held by a request still running."""

    def held_elsewhere(identity: Any, *args: Any) -> Any:
        raise KeyInProgress(identity.key)

    monkeypatch.setattr(units, "arbitrate", held_elsewhere)
    yield


def test_the_default_is_detail_and_code(api: APIClient, key: str) -> None:
    response = reused(api, key)
    assert response.status_code == 422
    assert response["Content-Type"] == "application/json"
    assert response.json() == {
        "detail": "This Idempotency-Key was already used for a different request. Use a new key "
        "for a new request; reuse a key only to retry the identical request.",
        "code": "idempotency_key_reused",
    }


@override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"})
def test_problem_details_for_a_reused_key(api: APIClient, key: str) -> None:
    response = reused(api, key)
    assert response.status_code == 422
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body == {
        "type": "urn:idempotency-app:problem:idempotency_key_reused",
        "title": "Idempotency-Key reused",
        "status": 422,
        "detail": body["detail"],
        "code": "idempotency_key_reused",
    }
    assert body["detail"].startswith("This Idempotency-Key was already used")


@override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"})
@pytest.mark.parametrize(
    ("url", "key", "code"),
    [
        ("/charges/", "", "idempotency_key_invalid"),
        ("/charges-required/", None, "idempotency_key_missing"),
    ],
)
def test_problem_details_for_key_errors(
    api: APIClient, url: str, key: str | None, code: str
) -> None:
    response = post(api, url, {"amount": 1}, key)
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert (body["type"], body["status"], body["code"]) == (
        f"urn:idempotency-app:problem:{code}",
        400,
        code,
    )


@override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"})
def test_problem_details_for_a_rolled_back_success(quiet_api: APIClient, key: str) -> None:
    response = post(quiet_api, "/patterns/rolls-back-on-purpose/", {"amount": 1}, key)
    assert response.status_code == 500
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["code"] == "request_rolled_back"


@override_settings(
    IDEMPOTENCY={
        "ERROR_FORMAT": "problem",
        "PROBLEM_TYPE_BASE": "https://api.example.com/problems/",
    }
)
def test_a_conflict_as_a_problem_says_when_to_retry(
    api: APIClient, key: str, in_progress: None
) -> None:
    response = post(api, "/charges/", {"amount": 1}, key)
    assert response.status_code == 409
    assert response["Retry-After"] == "1"
    body = json.loads(response.content)
    assert body["type"] == "https://api.example.com/problems/request_in_progress"
    assert body["title"] == "Request in progress"


@override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"}, REST_FRAMEWORK=STANDARDIZED)
def test_problem_details_whatever_the_exception_handler(api: APIClient, key: str) -> None:
    response = reused(api, key)
    assert response["Content-Type"] == "application/problem+json"
    assert json.loads(response.content)["code"] == "idempotency_key_reused"


@override_settings(IDEMPOTENCY={"ERROR_FORMAT": "handler"}, REST_FRAMEWORK=STANDARDIZED)
def test_drf_standardized_errors_reports_one_error(api: APIClient, key: str) -> None:
    response = reused(api, key)
    assert response.status_code == 422
    assert response.json() == {
        "type": "client_error",
        "errors": [
            {
                "code": "idempotency_key_reused",
                "detail": "This Idempotency-Key was already used for a different request. Use a "
                "new key for a new request; reuse a key only to retry the identical request.",
                "attr": None,
            }
        ],
    }


@override_settings(IDEMPOTENCY={"ERROR_FORMAT": "handler"}, REST_FRAMEWORK=STANDARDIZED)
def test_drf_standardized_errors_keeps_retry_after(
    api: APIClient, key: str, in_progress: None
) -> None:
    response = post(api, "/charges/", {"amount": 1}, key)
    assert response.status_code == 409 and response["Retry-After"] == "1"
    assert response.json()["errors"][0]["code"] == "request_in_progress"


def test_drf_standardized_errors_splits_the_default_body(api: APIClient, key: str) -> None:
    """Why W007 exists: the default body becomes two errors."""
    with override_settings(REST_FRAMEWORK=STANDARDIZED):
        errors = reused(api, key).json()["errors"]
    assert [e["attr"] for e in errors] == ["detail", "code"]


@override_settings(IDEMPOTENCY={"ERROR_FORMAT": "handler"})
def test_handler_format_with_drf_default_handler(api: APIClient, key: str) -> None:
    response = reused(api, key)
    assert list(response.json()) == ["detail"]
    assert response.data["detail"].code == "idempotency_key_reused"


def test_respond_outside_a_view() -> None:
    response = problems.respond(RequestInProgress(retry_after=3))
    assert response.status_code == 409 and response["Retry-After"] == "3"
    assert json.loads(response.content)["status"] == 409


def check_ids(**idempotency: Any) -> list[str]:
    with override_settings(IDEMPOTENCY=idempotency):
        return [m.id or "" for m in checks.check_error_format()]


def test_checks_accept_the_formats_and_the_settings() -> None:
    for error_format in problems.FORMATS:
        assert check_ids(ERROR_FORMAT=error_format, PROBLEM_TYPE_BASE="tag:x.example,2025:") == []
    from idempotency_app import checks

    with override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem", "PROBLEM_TYPE_BASE": "urn:x:"}):
        found = {m.id for m in checks.check_settings()}
    assert "idempotency_app.E002" not in found, "the keys are known ones"


@pytest.mark.parametrize(
    ("idempotency", "expected"),
    [
        ({"ERROR_FORMAT": "rfc9457"}, ["idempotency_app.E019"]),
        ({"PROBLEM_TYPE_BASE": "/problems/"}, ["idempotency_app.E020"]),
        ({"PROBLEM_TYPE_BASE": "https://x.example/a b/"}, ["idempotency_app.E020"]),
        ({"PROBLEM_TYPE_BASE": 42}, ["idempotency_app.E020"]),
    ],
)
def test_checks_refuse_bad_values(idempotency: dict[str, Any], expected: list[str]) -> None:
    assert check_ids(**idempotency) == expected


def test_check_warns_when_drf_standardized_errors_would_split_the_body() -> None:
    with override_settings(REST_FRAMEWORK=STANDARDIZED):
        assert check_ids() == ["idempotency_app.W007"]
        assert check_ids(ERROR_FORMAT="handler") == []
