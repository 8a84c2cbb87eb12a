"""What a replay carries: the first response's body with that response's
representation (its language), to the question it answered (its Accept),
and what the retry-storm guard's replay may refuse without letting the
view run again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.http import HttpResponse
from django.test.utils import override_settings
from django.urls import include, path
from django.utils import translation
from rest_framework.decorators import api_view
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient

from idempotency_app import signals
from idempotency_app.decorators import idempotent
from idempotency_app.models import IdempotencyRecord
from tests.conftest import claims, post
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.test_replay")]

INVALID = {"raise": "validation"}
JSON, HTML = "application/json", "text/html"


@api_view(["POST"])
@idempotent
def greeting(request: Request) -> HttpResponse:
    """A body in the language the request was answered in; or, asked for
    ``plain``, text whatever the client accepts."""
    if request.data.get("plain"):
        Charge.objects.create(label="plain")
        return HttpResponse(b"plain", status=request.data["plain"], content_type="text/plain")
    if request.data.get("invalid"):
        raise ValidationError({"amount": [f"invalid ({translation.get_language()})"]})
    charge = Charge.objects.create(label=translation.get_language() or "")
    response = Response({"id": charge.pk, "language": charge.label}, status=201)
    if request.data.get("language"):
        response["Content-Language"] = request.data["language"]
    return response


urlpatterns = [path("greeting/", greeting), path("", include("tests.urls"))]


@pytest.fixture
def executions() -> Iterator[list[int]]:
    runs: list[int] = []

    def count(sender: Any, status: int, **kwargs: Any) -> None:
        runs.append(status)

    signals.executed.connect(count, weak=False)
    yield runs
    signals.executed.disconnect(count)


def stored_headers() -> dict[str, str]:
    return dict(json.loads(IdempotencyRecord.objects.get().response_headers))


# -- the retry-storm guard against alternating Accept ----------------------------------


@pytest.mark.parametrize(("first", "other"), [(JSON, HTML), (HTML, JSON)])
def test_alternating_accept_never_lets_a_storm_run_the_view_again(
    api: APIClient, key: str, executions: list[int], first: str, other: str
) -> None:
    """The cached 400 is in ``first``'s type; a retry asking only for
    ``other`` gets 406, and keeps the window like a served 400 does."""
    codes = [
        post(api, "/charges/", INVALID, key, HTTP_ACCEPT=first if i % 2 == 0 else other).status_code
        for i in range(7)
    ]
    assert executions == [400], "the view ran once in the whole storm"
    assert codes == [400, 406, 400, 406, 400, 406, 400]
    assert not claims().exists()
    assert IdempotencyRecord.objects.get().status == "released", "the marker stays"


def test_the_guards_406_says_what_to_accept(api: APIClient, key: str) -> None:
    post(api, "/charges/", INVALID, key, HTTP_ACCEPT=JSON)
    refused = post(api, "/charges/", INVALID, key, HTTP_ACCEPT=HTML)
    assert refused.status_code == 406
    assert b"idempotency_replay_not_acceptable" in refused.content
    assert b"application/json" in refused.content
    with override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"}):
        problem = post(api, "/charges/", INVALID, key, HTTP_ACCEPT=HTML)
    assert problem.status_code == 406
    assert problem["Content-Type"] == "application/problem+json"
    assert problem.json()["code"] == "idempotency_replay_not_acceptable"


def test_a_corrected_request_still_runs_after_a_refused_replay(
    api: APIClient, key: str, executions: list[int]
) -> None:
    post(api, "/charges/", INVALID, key, HTTP_ACCEPT=JSON)
    post(api, "/charges/", INVALID, key, HTTP_ACCEPT=HTML)
    fixed = post(api, "/charges/", {"label": "fixed"}, key, HTTP_ACCEPT=HTML)
    assert fixed.status_code == 201 and "Idempotent-Replayed" not in fixed
    assert executions == [400, 201]
