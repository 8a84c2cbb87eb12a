"""The key is read from the header ``IDEMPOTENCY['HEADER']`` names as
``request.headers`` would read it: in any case, with ``-`` and ``_``
alike, on sync and async views; another header is no key."""

from __future__ import annotations

import pytest
from django.test.utils import override_settings
from rest_framework.test import APIClient

from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("setting", ["X-Request-Key", "x-request-key", "X_REQUEST_KEY"])
@pytest.mark.parametrize("url", ["/charges/", "/async/charges/"])
def test_the_header_the_setting_names_is_the_key(
    api: APIClient, key: str, setting: str, url: str
) -> None:
    with override_settings(IDEMPOTENCY={"HEADER": setting}):
        first = api.post(url, {"label": "a"}, format="json", HTTP_X_REQUEST_KEY=key)
        again = api.post(url, {"label": "a"}, format="json", HTTP_X_REQUEST_KEY=key)
        other = api.post(url, {"label": "a"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == again.status_code == other.status_code == 201
    assert "Idempotent-Replayed" not in first and "Idempotent-Replayed" not in other
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert Charge.objects.count() == 2
