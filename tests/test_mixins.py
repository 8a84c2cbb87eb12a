"""IdempotentMixin on an APIView and a ModelViewSet."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from rest_framework import viewsets
from rest_framework.test import APIClient
from rest_framework.views import APIView

from idempotency_app.mixins import IdempotentMixin
from idempotency_app.models import IdempotencyRecord
from tests.conftest import claims, post
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)


def test_mixin_covers_post_and_patch(api: APIClient, key: str) -> None:
    for method in ("post", "patch"):
        first = getattr(api, method)(
            "/mixin-charges/", {"label": method}, format="json", HTTP_IDEMPOTENCY_KEY=key + method
        )
        again = getattr(api, method)(
            "/mixin-charges/", {"label": method}, format="json", HTTP_IDEMPOTENCY_KEY=key + method
        )
        assert first.status_code == 201
        assert again["Idempotent-Replayed"] == "true"
        assert again.content == first.content
    assert Charge.objects.count() == 2


def test_mixin_leaves_other_methods_alone(api: APIClient, key: str) -> None:
    api.put("/mixin-charges/", {"label": "p"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    api.put("/mixin-charges/", {"label": "p"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert Charge.objects.count() == 2
    assert not IdempotencyRecord.objects.exists()


def test_viewset_create_replays(api: APIClient, key: str) -> None:
    first = post(api, "/viewset-charges/", {"label": "v", "amount": 4}, key)
    again = post(api, "/viewset-charges/", {"label": "v", "amount": 4}, key)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert Charge.objects.count() == 1


def test_viewset_serializer_error_is_a_transient_400(api: APIClient, key: str) -> None:
    bad = post(api, "/viewset-charges/", {"label": "v", "amount": -1}, key)
    assert bad.status_code == 400
    assert not claims().exists()
    assert (
        post(api, "/viewset-charges/", {"label": "v", "amount": -1}, key)["Idempotent-Replayed"]
        == "true"
    )
    fixed = post(api, "/viewset-charges/", {"label": "v", "amount": 1}, key)
    assert fixed.status_code == 201


def test_viewset_partial_update_is_covered(api: APIClient, key: str) -> None:
    charge = post(api, "/viewset-charges/", {"label": "v", "amount": 4}, None).json()
    url = f"/viewset-charges/{charge['id']}/"
    first = api.patch(url, {"amount": 5}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    again = api.patch(url, {"amount": 5}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == 200 and again["Idempotent-Replayed"] == "true"


def test_viewset_missing_object_404_is_stored(api: APIClient, key: str) -> None:
    first = api.patch(
        "/viewset-charges/999999/", {"amount": 5}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )
    again = api.patch(
        "/viewset-charges/999999/", {"amount": 5}, format="json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert first.status_code == again.status_code == 404
    assert again["Idempotent-Replayed"] == "true"


def test_reads_are_never_idempotent(api: APIClient, key: str) -> None:
    assert api.get("/viewset-charges/", HTTP_IDEMPOTENCY_KEY=key).status_code == 200
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("base", [APIView, viewsets.ModelViewSet], ids=["APIView", "ModelViewSet"])
def test_a_mixin_listed_after_the_drf_base_is_refused(base: type) -> None:
    """After the base class, the mixin's initial() would never run: every
    request would execute unprotected. Refused when the class is defined."""
    with pytest.raises(ImproperlyConfigured, match=r"List the mixin first"):
        type("MixinAfterBase", (base, IdempotentMixin), {"__module__": __name__})


def test_the_mixin_may_follow_other_mixins() -> None:
    class Audited:
        def initial(self, request: Any, *args: Any, **kwargs: Any) -> None:
            super().initial(request, *args, **kwargs)  # type: ignore[misc]

    class View(Audited, IdempotentMixin, APIView):
        pass

    assert View.__mro__.index(IdempotentMixin) < View.__mro__.index(APIView)
