"""The example payments API as a client sees it: a charge, its replay, and
the answers that say what happened when a retry cannot be a replay."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.test.utils import override_settings
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def account(transactional_db: Any, user: Any) -> Iterator[Any]:
    from example_project.payments.models import Account

    with override_settings(ROOT_URLCONF="example_project.urls"):
        yield Account.objects.create(owner=user, name="main", balance=10_000)


def charge(api: APIClient, account: Any, key: str, accept: str = "application/json") -> Any:
    return api.post(
        f"/api/accounts/{account.pk}/charges/",
        {"amount": 2500, "description": "Coffee beans"},
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
        HTTP_ACCEPT=accept,
    )


def test_a_retried_charge_is_charged_once(api: APIClient, account: Any, key: str) -> None:
    first = charge(api, account, key)
    again = charge(api, account, key)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    account.refresh_from_db()
    assert account.balance == 10_000 - 2500


def test_a_retry_that_asks_for_html_gets_406_not_a_second_charge(
    api: APIClient, account: Any, key: str
) -> None:
    assert charge(api, account, key).status_code == 201
    html = charge(api, account, key, accept="text/html")
    assert html.status_code == 406
    assert b"idempotency_replay_not_acceptable" in html.content
    assert charge(api, account, key)["Idempotent-Replayed"] == "true"
    account.refresh_from_db()
    assert account.balance == 10_000 - 2500


def test_the_example_endpoints_prove_themselves_with_assert_idempotent(
    api: APIClient, account: Any
) -> None:
    """What an integrator writes in their own suite: a charge (the decorator)
    and an account (the mixin) replay, refuse a reused key and run once
    under concurrent duplicates."""
    from example_project.payments.models import Account, Charge
    from idempotency_app.testing import assert_idempotent

    charges = f"/api/accounts/{account.pk}/charges/"
    assert_idempotent(
        api, charges, {"amount": 100, "description": "Tea"}, effects=Charge.objects.count
    )
    assert_idempotent(api, "/api/accounts/", {"name": "savings"}, effects=Account.objects.count)
    account.refresh_from_db()
    assert account.balance == 10_000 - 2 * 100
