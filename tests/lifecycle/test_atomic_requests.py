"""Nested mode: with ATOMIC_REQUESTS the claim shares the request's transaction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from rest_framework.test import APIClient

from idempotency_app.models import IdempotencyRecord
from tests.conftest import post
from tests.testapp.models import Charge, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    yield


def test_replay_under_atomic_requests(api: APIClient, key: str) -> None:
    first = post(api, "/charges/", {"label": "a"}, key)
    again = post(api, "/charges/", {"label": "a"}, key)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert (Charge.objects.count(), LedgerEntry.objects.count()) == (1, 1)
    assert IdempotencyRecord.objects.get().status == "completed"


def test_5xx_rolls_back_claim_and_work(api: APIClient, key: str) -> None:
    assert post(api, "/charges/", {"label": "a", "respond": 503}, key).status_code == 503
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0
    assert post(api, "/charges/", {"label": "a"}, key).status_code == 201


def test_exception_rolls_back_claim_and_work(user: Any, key: str) -> None:
    client = APIClient(raise_request_exception=False)
    client.force_authenticate(user)
    assert post(client, "/charges/", {"label": "a", "raise": "crash"}, key).status_code == 500
    assert not IdempotencyRecord.objects.exists()
    assert post(client, "/charges/", {"label": "a"}, key).status_code == 201


@pytest.mark.parametrize(("exc", "code"), [("not_found", 404), ("forbidden", 403)])
def test_raised_errors_are_released_not_a_500(
    api: APIClient, key: str, exc: str, code: int
) -> None:
    """DRF rolls back the transaction of a handled exception under
    ATOMIC_REQUESTS, so the outcome cannot commit: it is released."""
    assert post(api, "/charges/", {"raise": exc}, key).status_code == code
    assert not IdempotencyRecord.objects.exists()
    assert post(api, "/charges/", {"raise": exc}, key).status_code == code


def test_mismatch_under_atomic_requests(api: APIClient, key: str) -> None:
    post(api, "/charges/", {"label": "a"}, key)
    assert post(api, "/charges/", {"label": "b"}, key).status_code == 422


def test_validation_error_is_guarded(api: APIClient, key: str) -> None:
    post(api, "/charges/", {"raise": "validation"}, key)
    assert post(api, "/charges/", {"raise": "validation"}, key)["Idempotent-Replayed"] == "true"
    assert not IdempotencyRecord.objects.exists()
