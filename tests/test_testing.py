"""``assert_idempotent`` passes on idempotent endpoints and fails, saying
why, on endpoints that are not."""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpResponse
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient

from idempotency_app import testing
from idempotency_app.decorators import idempotent
from idempotency_app.testing import assert_idempotent
from tests.testapp import patterns, views
from tests.testapp.models import Charge


@api_view(["POST"])
def unprotected(request: Request) -> Response:
    charge = Charge.objects.create(label="plain", amount=int(request.data.get("amount", 0)))
    return Response({"id": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def refuses(request: Request) -> Response:
    return Response({"amount": ["Always wrong."]}, status=400)


urlpatterns = [
    path("charges/", views.charge_fn),
    path("mixin-charges/", views.MixinChargeView.as_view()),
    path("unprotected/", unprotected),
    path("refuses/", refuses),
    path("same-fingerprint/", patterns.constant_fingerprint_a),
]

pytestmark = [pytest.mark.urls("tests.test_testing")]


def charges() -> int:
    return Charge.objects.count()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", ["/charges/", "/mixin-charges/"])
def test_an_idempotent_endpoint_passes(api: APIClient, url: str) -> None:
    proof = assert_idempotent(api, url, {"amount": 7}, effects=charges, concurrent=3)
    assert proof.first.status_code == 201
    assert proof.replay["Idempotent-Replayed"] == "true"
    assert proof.mismatch.status_code == 422
    assert len(proof.concurrent) == 3
    assert charges() == 2


@pytest.mark.django_db(transaction=True)
def test_an_unprotected_endpoint_fails_at_once(api: APIClient) -> None:
    with pytest.raises(AssertionError, match="was not stored"):
        assert_idempotent(api, "/unprotected/", {"amount": 7})


@pytest.mark.django_db(transaction=True)
def test_a_first_request_that_is_refused_is_reported(api: APIClient) -> None:
    with pytest.raises(AssertionError, match=r"400 was not stored.*Always wrong"):
        assert_idempotent(api, "/refuses/", {"amount": 7})


@pytest.mark.django_db(transaction=True)
def test_a_key_reused_with_another_body_must_be_refused(api: APIClient) -> None:
    with pytest.raises(AssertionError, match="another body got 201, not 422"):
        assert_idempotent(api, "/same-fingerprint/", {"amount": 7})


@pytest.mark.django_db(transaction=True)
def test_effects_that_grow_twice_fail(api: APIClient) -> None:
    with pytest.raises(AssertionError, match="effects grew by 2, not 1"):
        assert_idempotent(api, "/charges/", {"amount": 7}, effects=lambda: 2 * charges())


ROLLED_BACK = b'{"detail": "...", "code": "request_rolled_back"}'


def refused_by_the_database(
    times: int, monkeypatch: pytest.MonkeyPatch, status: int = 503
) -> list[int]:
    """The first ``times`` rounds of concurrent copies come back refused
    without keeping anything, as SQLite's shared cache answers concurrent
    writers (503 at the claim, 409 while the winner runs, 500
    ``request_rolled_back`` at the winner's COMMIT); the rounds sent are
    counted."""
    real = testing._at_once
    rounds: list[int] = []

    def at_once(count: int, send: Any, client: Any) -> list[Any]:
        rounds.append(count)
        if len(rounds) > times:
            return real(count, send, client)
        if status == 500:
            return [HttpResponse(status=500, content=ROLLED_BACK)] * count
        return [HttpResponse(status=status, headers={"Retry-After": "1"})] * count

    monkeypatch.setattr(testing, "_at_once", at_once)
    return rounds


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("status", [503, 409, 500])
def test_a_round_the_database_refused_is_sent_again(
    api: APIClient, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    rounds = refused_by_the_database(2, monkeypatch, status)
    proof = assert_idempotent(api, "/charges/", {"amount": 7}, effects=charges)
    assert rounds == [2, 2, 2]
    assert sorted(r.status_code for r in proof.concurrent)[0] == 201


@pytest.mark.django_db(transaction=True)
def test_a_database_that_refuses_every_round_fails_the_proof(
    api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = refused_by_the_database(testing.ROUNDS, monkeypatch)
    with pytest.raises(AssertionError, match=r"ran 0 times \(statuses \[503, 503\]\)"):
        assert_idempotent(api, "/charges/", {"amount": 7})
    assert len(rounds) == testing.ROUNDS


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_answer_whose_work_was_kept_fails_the_proof(
    api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 500 ``request_rolled_back`` is a round that kept nothing only if
    the effects say so: here both copies' work was kept all the same."""
    made: list[int] = []

    def at_once(count: int, send: Any, client: Any) -> list[Any]:
        made.append(1)
        return [HttpResponse(status=500, content=ROLLED_BACK)] * count

    monkeypatch.setattr(testing, "_at_once", at_once)
    with pytest.raises(AssertionError, match="effects grew by 2, not 1"):
        assert_idempotent(
            api, "/charges/", {"amount": 7}, effects=lambda: charges() + 2 * len(made)
        )


@pytest.mark.django_db
def test_concurrent_duplicates_need_committed_data(api: APIClient) -> None:
    with pytest.raises(RuntimeError, match="transactional_db"):
        assert_idempotent(api, "/charges/", {"amount": 7})
    proof = assert_idempotent(api, "/charges/", {"amount": 7}, concurrent=0, effects=charges)
    assert proof.concurrent == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"method": "get"}, "method='get'"),
        ({"changed": {"amount": 7}}, "must differ"),
        ({"concurrent": 1}, "0, or 2 and more"),
    ],
)
def test_bad_arguments_are_refused(api: APIClient, arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        assert_idempotent(api, "/charges/", {"amount": 7}, **arguments)


@pytest.mark.django_db
def test_a_body_that_is_not_a_dict_needs_changed(api: APIClient) -> None:
    with pytest.raises(ValueError, match="Pass changed="):
        assert_idempotent(api, "/charges/", [1, 2], concurrent=0)
