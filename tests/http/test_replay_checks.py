"""What every replay checks before it answers, wherever it is held (read
from the database or from ``REPLAY_CACHE``): the format the retry's URL
forces, read as DRF's own negotiation reads it (``URL_FORMAT_OVERRIDE``, a
format suffix), and the per-request options the claim's policy judges.

The stored response is JSON unless a test says otherwise. A retry that DRF
renders as the browsable API (HTML) must get 406; one DRF renders as JSON,
or one with neither a forced format nor an Accept, the replay."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test.utils import override_settings
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient, APIRequestFactory
from rest_framework.urlpatterns import format_suffix_patterns
from rest_framework.views import APIView

from idempotency_app.decorators import idempotent
from idempotency_app.http.options import Options
from idempotency_app.mixins import IdempotentMixin
from tests.conftest import post, replay_cache
from tests.testapp.models import Charge
from tests.testapp.views import do_charge
from tests.urls import urlpatterns as base

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]


class PerRequestOptionsView(IdempotentMixin, APIView):
    """Options chosen per request (``get_idempotency_options`` is the
    mixin's override point): a patient client asks to wait for an in-flight
    duplicate longer than the default LEASE (60 s) allows, which the claim's
    policy refuses."""

    def get_idempotency_options(self) -> Options:
        if self.request.headers.get("X-Patient"):
            return Options(wait=90)
        return super().get_idempotency_options()

    def post(self, request: Request) -> Response:
        return do_charge(request)


@api_view(["POST"])
@idempotent
def suffixed(request: Request, format: str | None = None) -> Response:
    return do_charge(request)


urlpatterns = [
    path("per-request-options/", PerRequestOptionsView.as_view()),
    *format_suffix_patterns([path("suffixed", suffixed)]),
    *base,
]

BODY = {"label": "a"}
WHERE = pytest.mark.parametrize("held_in_memory", [False, True], ids=["database", "memory"])


def format_override(name: Any) -> Any:
    return override_settings(
        REST_FRAMEWORK={**getattr(settings, "REST_FRAMEWORK", {}), "URL_FORMAT_OVERRIDE": name}
    )


def drf_renders(query: str, accept: str | None = None) -> str:
    """The media type DRF's own negotiation picks for a request."""
    extra = {"HTTP_ACCEPT": accept} if accept else {}
    request = Request(APIRequestFactory().post("/charges/" + query, **extra))
    renderer, _ = DefaultContentNegotiation().select_renderer(
        request, [JSONRenderer(), BrowsableAPIRenderer()]
    )
    return renderer.media_type


def answer(api: APIClient, key: str, url: str, **extra: Any) -> str:
    response = post(api, url, BODY, key, **extra)
    if response.status_code == 406:
        return "406"
    assert response.get("Idempotent-Replayed") == "true", response.status_code
    return "replayed"


def expected(media_type: str) -> str:
    return "406" if media_type.startswith("text/html") else "replayed"


@WHERE
def test_an_empty_url_format_override_forces_as_drf_does(
    api: APIClient, key: str, held_in_memory: bool
) -> None:
    """URL_FORMAT_OVERRIDE = "": DRF's negotiation reads
    ``query_params.get("")``, so ``?=api`` forces the browsable API (HTML);
    the stored JSON must be refused, as it is for ``?format=api`` with the
    default setting."""
    with replay_cache(5 if held_in_memory else 0), format_override(""):
        assert drf_renders("?=api").startswith("text/html")
        assert post(api, "/charges/", BODY, key).status_code == 201
        assert answer(api, key, "/charges/?=api") == "406"


@WHERE
def test_no_url_format_override_forces_nothing(
    api: APIClient, key: str, held_in_memory: bool
) -> None:
    """URL_FORMAT_OVERRIDE = None: DRF forces nothing, whatever the query
    holds (``?=api`` included); the retry is judged by its Accept (HTML
    asked: 406; none: the replay)."""
    with replay_cache(5 if held_in_memory else 0), format_override(None):
        assert post(api, "/charges/", BODY, key).status_code == 201
        assert answer(api, key, "/charges/?=api") == "replayed"
        assert answer(api, key, "/charges/?format=api") == "replayed"
        assert answer(api, key, "/charges/?=json", HTTP_ACCEPT="text/html") == "406"


@WHERE
def test_another_url_format_override_name(api: APIClient, key: str, held_in_memory: bool) -> None:
    with replay_cache(5 if held_in_memory else 0), format_override("fmt"):
        assert post(api, "/charges/", BODY, key).status_code == 201
        assert answer(api, key, "/charges/?fmt=api") == "406"
        assert answer(api, key, "/charges/?fmt=json") == "replayed"
        assert answer(api, key, "/charges/?format=api") == "replayed"


@WHERE
@pytest.mark.parametrize(
    "query",
    [
        "?format=api&format=json",
        "?format=json&format=api",
        "?format=",
        "?format=&format=api",
        "?format=api&format=",
        "?Format=api",
    ],
)
def test_repeated_and_empty_format_params_as_drf_reads_them(
    api: APIClient, key: str, held_in_memory: bool, query: str
) -> None:
    media_type = drf_renders(query)
    with replay_cache(5 if held_in_memory else 0):
        assert post(api, "/charges/", BODY, key).status_code == 201
        assert answer(api, key, "/charges/" + query) == expected(media_type)


@WHERE
def test_a_format_suffix_route(api: APIClient, key: str, held_in_memory: bool) -> None:
    with replay_cache(5 if held_in_memory else 0):
        assert post(api, "/suffixed.json", BODY, key).status_code == 201
        assert answer(api, key, "/suffixed.json") == "replayed"
        assert answer(api, key, "/suffixed.json?format=api") == "replayed"
    assert Charge.objects.count() == 1


@WHERE
def test_a_suffix_forces_over_the_query(api: APIClient, key: str, held_in_memory: bool) -> None:
    """DRF: ``format_suffix or query_params.get(...)``: the suffix wins."""
    with replay_cache(5 if held_in_memory else 0):
        first = post(api, "/suffixed.api", BODY, key)
        assert first.status_code == 201 and first["Content-Type"].startswith("text/html")
        assert answer(api, key, "/suffixed.api?format=json") == "replayed"


@WHERE
def test_an_accept_with_q_zero(api: APIClient, key: str, held_in_memory: bool) -> None:
    """``application/json;q=0`` refuses JSON (RFC 9110); forced by
    ``?format=json``, DRF renders JSON whatever the Accept's q."""
    with replay_cache(5 if held_in_memory else 0):
        assert post(api, "/charges/", BODY, key).status_code == 201
        assert answer(api, key, "/charges/", HTTP_ACCEPT="application/json;q=0") == "406"
        assert (
            answer(api, key, "/charges/?format=json", HTTP_ACCEPT="application/json;q=0")
            == "replayed"
        )


@WHERE
def test_without_url_format_override_an_empty_named_param_changes_nothing(
    api: APIClient, key: str, held_in_memory: bool
) -> None:
    """A stored browsable-API page (HTML), retried with ``Accept: */*``:
    replayed (anything is accepted). With URL_FORMAT_OVERRIDE None, ``?=x``
    means nothing to DRF, so the answer must be the same (it was once read
    as a forced format, ``query_params.get("")``, and refused)."""
    with replay_cache(5 if held_in_memory else 0), format_override(None):
        first = post(api, "/charges/", BODY, key, HTTP_ACCEPT="text/html")
        assert first.status_code == 201 and first["Content-Type"].startswith("text/html")
        plain = answer(api, key, "/charges/", HTTP_ACCEPT="*/*")
        assert answer(api, key, "/charges/?=x", HTTP_ACCEPT="*/*") == plain == "replayed"


@WHERE
def test_a_format_forced_in_the_query_decides_what_a_replay_may_be(
    api: APIClient, key: str, held_in_memory: bool
) -> None:
    """No Accept header, but ``?format=`` forces a renderer: the stored JSON
    is refused to ``?format=api`` (an HTML page) and replayed to
    ``?format=json``; a query without the parameter takes anything."""
    with replay_cache(5 if held_in_memory else 0):
        first = post(api, "/charges/", BODY, key)
        html = post(api, "/charges/?format=api", BODY, key)
        json_ = post(api, "/charges/?format=json", BODY, key)
        other = post(api, "/charges/?page=2", BODY, key)
    assert first.status_code == 201
    assert html.status_code == 406, html.content[:200]
    assert b"idempotency_replay_not_acceptable" in html.content
    assert [json_["Idempotent-Replayed"], other["Idempotent-Replayed"]] == ["true", "true"]
    assert Charge.objects.count() == 1


@WHERE
def test_options_the_policy_refuses_are_refused_wherever_the_replay_is_held(
    api: APIClient, key: str, held_in_memory: bool
) -> None:
    """The same retry, with per-request options the claim's policy refuses:
    ImproperlyConfigured whether its replay would come from the database or
    from memory (answering from memory first once skipped the policy)."""
    url = "/per-request-options/"
    with replay_cache(5 if held_in_memory else 0):
        assert post(api, url, BODY, key).status_code == 201
        with pytest.raises(ImproperlyConfigured):
            post(api, url, BODY, key, HTTP_X_PATIENT="1")
        assert post(api, url, BODY, key)["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
