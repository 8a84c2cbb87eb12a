"""adrf async views under @idempotent and IdempotentMixin: the same answers,
headers and commit rule as sync views. Through the test client (Django runs
the async view with async_to_sync) and through Django's ASGI handler
(AsyncClient). The races through uvicorn are in test_async_race.py."""

from __future__ import annotations

import asyncio
from base64 import b64encode
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.test import AsyncClient
from django.test.utils import override_settings
from django.views import View
from rest_framework.test import APIClient

from idempotency_app.decorators import idempotent
from idempotency_app.mixins import IdempotentMixin
from idempotency_app.models import IdempotencyRecord
from tests.conftest import claims, post
from tests.testapp.models import Charge, LedgerEntry

pytest.importorskip("adrf", reason="needs adrf: pip install -e '.[test]'")

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])

CHARGES = "/async/charges/"


def test_first_request_runs_and_a_retry_replays(api: APIClient, key: str) -> None:
    first = post(api, CHARGES, {"label": "a", "amount": 5}, key)
    again = post(api, CHARGES, {"label": "a", "amount": 5}, key)
    assert first.status_code == 201 and "Idempotent-Replayed" not in first
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert again["Location"] == first["Location"]
    assert again["Idempotency-Expires"] == first["Idempotency-Expires"]
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1
    assert IdempotencyRecord.objects.get().operation == "POST async/charges/"


def test_same_headers_as_the_sync_view(api: APIClient) -> None:
    sync = post(api, "/charges/", {"label": "a"}, "k-sync")
    asynchronous = post(api, CHARGES, {"label": "a"}, "k-async")
    expected = {"Content-Type", "Location", "Idempotency-Expires", "Allow", "Vary"}
    assert {h for h, _ in sync.items()} & expected == {
        h for h, _ in asynchronous.items()
    } & expected


def test_no_key_runs_without_idempotency(api: APIClient) -> None:
    assert post(api, CHARGES, {"label": "a"}, None).status_code == 201
    assert post(api, CHARGES, {"label": "a"}, None).status_code == 201
    assert Charge.objects.count() == 2 and not IdempotencyRecord.objects.exists()


def test_bad_keys_get_the_sync_error_codes(api: APIClient, key: str) -> None:
    missing = post(api, "/async/charges-required/", {"label": "a"}, None)
    assert (missing.status_code, missing.json()["code"]) == (400, "idempotency_key_missing")
    invalid = post(api, CHARGES, {"label": "a"}, "   ")
    assert (invalid.status_code, invalid.json()["code"]) == (400, "idempotency_key_invalid")
    post(api, CHARGES, {"label": "a"}, key)
    reused = post(api, CHARGES, {"label": "b"}, key)
    assert (reused.status_code, reused.json()["code"]) == (422, "idempotency_key_reused")


def test_in_progress_is_409_with_retry_after(api: APIClient, key: str, user: Any) -> None:
    post(api, CHARGES, {"label": "a"}, key)
    record = IdempotencyRecord.objects.get()
    Charge.objects.all().delete()
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        status="in_progress", response_body=None, token="another-worker"
    )
    response = post(api, CHARGES, {"label": "a"}, key)
    assert response.status_code == 409
    assert response.json()["code"] == "request_in_progress"
    assert int(response["Retry-After"]) >= 1
    assert Charge.objects.count() == 0


@pytest.mark.parametrize("how", [{"respond": 503}, {"raise": "crash"}])
def test_failures_roll_back_the_writes_and_release(user: Any, key: str, how: Any) -> None:
    api = APIClient(raise_request_exception=False)
    api.force_authenticate(user)
    response = post(api, CHARGES, {"label": "a", **how}, key)
    assert response.status_code in (500, 503)
    assert Charge.objects.count() == 0, "the view's async writes rolled back with the unit"
    assert not IdempotencyRecord.objects.exists()
    assert post(api, CHARGES, {"label": "a"}, key).status_code == 201


def test_a_caught_database_error_is_no_success(quiet_api: APIClient, key: str) -> None:
    from tests.testapp.models import Tag

    Tag.objects.create(name="vip")
    response = post(quiet_api, "/async/tag-if-new/", {"tag": "vip"}, key)
    assert response.status_code == 500
    assert response.json()["code"] == "request_rolled_back"
    assert Charge.objects.count() == 0 and not IdempotencyRecord.objects.exists()


def test_a_write_to_another_database_is_refused(quiet_api: APIClient, key: str) -> None:
    from tests.testapp.models import AuditEntry

    response = post(quiet_api, "/async/writes-to-other-database/", {}, key)
    assert response.status_code == 500
    assert AuditEntry.objects.using("other").count() == 0, "the refused write never ran"
    assert Charge.objects.count() == 0 and not IdempotencyRecord.objects.exists()


def test_validation_error_is_released_and_guarded(api: APIClient, key: str) -> None:
    first = post(api, CHARGES, {"raise": "validation"}, key)
    again = post(api, CHARGES, {"raise": "validation"}, key)
    assert first.status_code == again.status_code == 400
    assert again["Idempotent-Replayed"] == "true"
    assert not claims().exists()


def test_deterministic_4xx_raised_in_the_view_is_stored(api: APIClient, key: str) -> None:
    first = post(api, CHARGES, {"raise": "not_found"}, key)
    again = post(api, CHARGES, {"raise": "not_found"}, key)
    assert first.status_code == again.status_code == 404
    assert again["Idempotent-Replayed"] == "true"


def test_apiview_method_mixin_and_viewset(api: APIClient, key: str) -> None:
    for url in ("/async/accounts/7/charges/", "/async/mixin-charges/", "/async/viewset-charges/"):
        assert post(api, url, {"label": url}, key + url).status_code == 201
        assert post(api, url, {"label": url}, key + url)["Idempotent-Replayed"] == "true"
    patch = api.patch(
        "/async/viewset-charges/9/", {"label": "p"}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert patch.status_code == 201 and patch.json()["pk"] == "9"
    assert Charge.objects.count() == 4
    assert IdempotencyRecord.objects.count() == 4


def test_mixin_leaves_safe_methods_alone(api: APIClient, key: str) -> None:
    response = api.get("/async/mixin-charges/", HTTP_IDEMPOTENCY_KEY=key)
    assert response.status_code == 200 and response.json() == {"count": 0}
    assert not IdempotencyRecord.objects.exists()


def test_disabled_is_a_pass_through(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        post(api, CHARGES, {"label": "a"}, key)
        post(api, CHARGES, {"label": "a"}, key)
    assert Charge.objects.count() == 2 and not IdempotencyRecord.objects.exists()


def test_through_the_asgi_handler(user: Any, key: str) -> None:
    """AsyncClient goes through Django's ASGIHandler: a thread-sensitive
    context per request, as under uvicorn."""
    auth = "Basic " + b64encode(b"alice:pw").decode()
    headers = {"Authorization": auth, "Idempotency-Key": key}

    async def scenario() -> list[Any]:
        client = AsyncClient()
        kwargs = {"content_type": "application/json", "headers": headers}
        crashed = AsyncClient(raise_request_exception=False)
        failed = await crashed.post(CHARGES, {"raise": "crash"}, **kwargs)
        first = await client.post(CHARGES, {"label": "asgi"}, **kwargs)
        again = await client.post(CHARGES, {"label": "asgi"}, **kwargs)
        return [failed, first, again]

    failed, first, again = async_to_sync(scenario)()
    assert failed.status_code == 500
    assert first.status_code == 201 and again.status_code == 201
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert list(Charge.objects.values_list("label", flat=True)) == ["asgi"]


def test_concurrent_requests_in_one_event_loop_run_once(user: Any, key: str) -> None:
    """Eight copies gathered on one loop through the ASGI handler: one runs,
    the rest wait for it (WAIT_FOR_IN_FLIGHT) and replay."""
    auth = "Basic " + b64encode(b"alice:pw").decode()

    async def scenario() -> list[Any]:
        client = AsyncClient()
        body = {"label": "gathered", "sleep": 0.3}
        headers = {"Authorization": auth, "Idempotency-Key": key}
        return await asyncio.gather(
            *(
                client.post(CHARGES, body, content_type="application/json", headers=headers)
                for _ in range(8)
            )
        )

    with override_settings(IDEMPOTENCY={"WAIT_FOR_IN_FLIGHT": 10}):
        responses = async_to_sync(scenario)()
    statuses = sorted((r.status_code, r.get("Idempotent-Replayed", "")) for r in responses)
    assert statuses == [(201, "")] + [(201, "true")] * 7
    assert Charge.objects.count() == 1 and LedgerEntry.objects.count() == 1


# -- refused when decorated ---------------------------------------------------


def test_mixin_on_a_plain_django_view_is_refused() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"without DRF.*APIView"):

        class Plain(IdempotentMixin, View):
            async def post(self, request: Any) -> None:
                return None


def test_decorator_above_api_view_is_refused() -> None:
    from adrf.decorators import api_view

    @api_view(["POST"])
    async def view(request: Any) -> None:
        return None

    with pytest.raises(TypeError, match="under @api_view"):
        idempotent(view)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_generator_handlers_are_refused(kind: str) -> None:
    if kind == "sync":

        def handler(request: Any) -> Any:
            yield b""

        target: Any = handler
    else:

        async def ahandler(request: Any) -> Any:
            yield b""

        target = ahandler
    with pytest.raises(TypeError, match="@idempotent cannot wrap the generator"):
        idempotent(target)


def test_the_test_urls_pass_the_view_check() -> None:
    from idempotency_app.checks import check_idempotent_views

    assert check_idempotent_views() == []


def test_idempotent_views_served_without_drf_fail_the_check() -> None:
    from idempotency_app.checks import check_idempotent_views

    with override_settings(ROOT_URLCONF="tests.testapp.plain_urls"):
        errors = check_idempotent_views()
    assert [e.id for e in errors] == ["idempotency_app.E030"] * 3
    assert "plain_async_view (route 'async/')" in errors[0].msg
    assert "plain_sync_view (route 'sync/')" in errors[1].msg
    assert "PlainView.post (route 'class/')" in errors[2].msg
    assert all("@api_view" in (e.hint or "") for e in errors)
