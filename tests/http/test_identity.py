"""Who a stored response belongs to, and which request it answers: never
another principal's, never another request's.

The principals are what DRF authentication classes return as
``request.user``: the user model, a proxy or a subclass of it, a model of
the project's own (a partner, an API client) whose pks overlap the users',
an unsaved instance, and an object that is no model at all (simplejwt's
``TokenUser``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.test.utils import isolate_apps, override_settings
from django.urls import include, path
from rest_framework.decorators import api_view, parser_classes
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient

from idempotency_app import service
from idempotency_app.decorators import idempotent
from idempotency_app.http import keys
from idempotency_app.models import IdempotencyRecord
from tests.conftest import post
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.http.test_identity")]

BODY = {"label": "a", "amount": 5}


class DecimalParser(JSONParser):
    """What payment APIs use, so that an amount is never a float."""

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        return json.loads(stream.read(), parse_float=Decimal)


@api_view(["POST"])
@parser_classes([DecimalParser])
@idempotent
def decimal_view(request: Request) -> Response:
    """Charges exactly the amount sent."""
    charge = Charge.objects.create(label=str(request.data["amount"]))
    return Response({"id": charge.pk, "amount": charge.label}, status=201)


urlpatterns = [path("decimal/", decimal_view), path("", include("tests.urls"))]


class TokenUser:
    """Like simplejwt's: built from a token's claims, no model behind it."""

    is_authenticated = True

    def __init__(self, pk: int) -> None:
        self.pk = self.id = pk


def as_principal(principal: Any) -> APIClient:
    """A client whose authentication class returns ``principal``."""
    client = APIClient()
    client.force_authenticate(principal)
    return client


def authenticated(instance: Any) -> Any:
    """A model instance as an authentication class may return it."""
    instance.is_authenticated = True
    return instance


@pytest.fixture
def user_models() -> Iterator[tuple[type[User], type[User]]]:
    """A proxy of the user model and a multi-table subclass of it."""
    with isolate_apps("tests.testapp"):

        class StaffUser(User):
            class Meta:
                proxy = True
                app_label = "testapp"

        class Member(User):
            class Meta:
                app_label = "testapp"

        yield StaffUser, Member


def scopes() -> list[str]:
    return sorted(IdempotencyRecord.objects.values_list("scope", flat=True))


# -- principals that share a pk ------------------------------------------------------


@pytest.mark.parametrize("model", [Group, Charge], ids=["auth.group", "testapp.charge"])
def test_a_principal_of_another_model_with_the_same_pk_is_another_scope(
    api: APIClient, user: User, key: str, model: Any
) -> None:
    partner = authenticated(model.objects.create(pk=user.pk))
    mine = post(api, "/charges/", BODY, key)
    theirs = post(as_principal(partner), "/charges/", BODY, key)
    again = post(as_principal(partner), "/charges/", BODY, key)
    assert (mine.status_code, theirs.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in theirs, "a partner was served a user's response"
    assert theirs.json()["id"] != mine.json()["id"]
    assert again["Idempotent-Replayed"] == "true" and again.content == theirs.content
    assert scopes() == sorted([f"user:{user.pk}", f"{model._meta.label_lower}:{user.pk}"])


def test_a_users_scope_stays_user_pk_so_stored_rows_keep_matching(
    api: APIClient, user: User, key: str
) -> None:
    """Rows stored before principals were told apart are ``user:<pk>``: a
    retry must still find them."""
    first = post(api, "/charges/", BODY, key)
    IdempotencyRecord.objects.update(scope=f"user:{user.pk}")  # what older rows hold
    again = post(api, "/charges/", BODY, key)
    assert scopes() == [f"user:{user.pk}"]
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content


def test_a_proxy_or_a_subclass_of_the_user_model_is_the_user(
    api: APIClient, user: User, key: str, user_models: tuple[type[User], type[User]]
) -> None:
    staff_model, member_model = user_models
    first = post(api, "/charges/", BODY, key)
    staff = staff_model.objects.get(pk=user.pk)
    member = member_model(user_ptr_id=user.pk, username=user.username)
    for principal in (staff, member):
        again = post(as_principal(principal), "/charges/", BODY, key)
        assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert Charge.objects.count() == 1
    assert scopes() == [f"user:{user.pk}"]


def test_a_proxy_or_a_child_of_another_model_is_that_model(user: User, key: str) -> None:
    """A proxy and a multi-table child share their pk with the row at the
    root of the inheritance: one principal, one scope."""
    group = authenticated(Group.objects.create(pk=user.pk + 1000))
    with isolate_apps("tests.testapp"):

        class Team(Group):
            class Meta:
                proxy = True
                app_label = "testapp"

        class Squad(Group):
            class Meta:
                app_label = "testapp"

        team = authenticated(Team.objects.get(pk=group.pk))
        squad = authenticated(Squad(group_ptr_id=group.pk))
        first = post(as_principal(group), "/charges/", BODY, key)
        for principal in (team, squad):
            again = post(as_principal(principal), "/charges/", BODY, key)
            assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert scopes() == [f"auth.group:{group.pk}"]


# -- principals the library cannot tell apart -----------------------------------------


@pytest.mark.parametrize(
    ("make", "named"),
    [
        pytest.param(
            lambda pk: User(username="ghost"), "django.contrib.auth.models.User", id="unsaved-user"
        ),
        pytest.param(
            lambda pk: authenticated(Group(name="g")),
            "django.contrib.auth.models.Group",
            id="unsaved-model",
        ),
        pytest.param(TokenUser, "tests.http.test_identity.TokenUser", id="not-a-model"),
    ],
)
def test_a_principal_that_cannot_be_identified_is_refused_and_logged(
    api: APIClient,
    user: User,
    key: str,
    caplog: pytest.LogCaptureFixture,
    make: Any,
    named: str,
) -> None:
    """Not ``user:None`` (every unsaved principal's), nor ``user:<pk>`` for
    a token whose claim happens to be a user's pk."""
    principal = make(user.pk)
    post(api, "/charges/", BODY, key)
    with caplog.at_level(logging.WARNING, logger="idempotency_app"):
        refused = post(as_principal(principal), "/charges/", BODY, key)
    assert refused.status_code == 400
    assert refused.json()["code"] == "idempotency_scope_missing"
    assert "without the Idempotency-Key header" in refused.json()["detail"]
    assert Charge.objects.count() == 1 and IdempotencyRecord.objects.count() == 1
    [record] = [r for r in caplog.records if r.name == "idempotency_app"]
    assert record.levelno == logging.WARNING
    assert named in record.getMessage() and 'IDEMPOTENCY["SCOPE"]' in record.getMessage()
    without_key = post(as_principal(principal), "/charges/", BODY, None)
    assert without_key.status_code == 201, "the endpoint works without a key"


def test_two_unsaved_principals_never_share_a_response(key: str, db: Any) -> None:
    first = post(as_principal(User(username="a")), "/charges/", BODY, key)
    second = post(as_principal(User(username="b")), "/charges/", BODY, key)
    assert first.status_code == second.status_code == 400
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()


def token_scope(request: Any) -> str | None:
    """How a project scopes a principal that is no model: by what its
    authentication verified (here the token's user id)."""
    return f"token:{request.user.id}" if request.user.is_authenticated else None


def test_a_custom_scope_identifies_custom_principals(key: str, db: Any) -> None:
    with override_settings(IDEMPOTENCY={"SCOPE": "tests.http.test_identity.token_scope"}):
        first = post(as_principal(TokenUser(7)), "/charges/", BODY, key)
        again = post(as_principal(TokenUser(7)), "/charges/", BODY, key)
        other = post(as_principal(TokenUser(8)), "/charges/", BODY, key)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in other
    assert scopes() == ["token:7", "token:8"]


def test_the_refusal_speaks_problem_details_too(key: str, db: Any) -> None:
    with override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"}):
        refused = post(as_principal(TokenUser(1)), "/charges/", BODY, key)
    assert refused.status_code == 400
    assert refused["Content-Type"] == "application/problem+json"
    assert refused.json()["code"] == "idempotency_scope_missing"


# -- scopes spelled like a hash --------------------------------------------------------


def tenant_scope(request: Any) -> str | None:
    return request.headers.get("X-Tenant")


def test_a_scope_spelled_like_another_scopes_hash_is_another_scope(
    api: APIClient, key: str
) -> None:
    long_tenant = "tenant:" + "x" * 300
    spelled_like_it = keys.bounded(long_tenant)  # "sha256:<hex>", short enough to keep
    with override_settings(IDEMPOTENCY={"SCOPE": "tests.http.test_identity.tenant_scope"}):
        first = post(api, "/charges/", BODY, key, HTTP_X_TENANT=long_tenant)
        second = post(api, "/charges/", BODY, key, HTTP_X_TENANT=spelled_like_it)
        again = post(api, "/charges/", BODY, key, HTTP_X_TENANT=spelled_like_it)
    assert "Idempotent-Replayed" not in second, "one tenant was served another's response"
    assert second.json()["id"] != first.json()["id"]
    assert again["Idempotent-Replayed"] == "true" and again.content == second.content
    assert len(set(scopes())) == 2


def test_the_service_api_keeps_such_scopes_apart_too(db: Any) -> None:
    long_scope = "webhooks:" + "x" * 300
    with service.once(long_scope, "evt_1", "payout") as run:
        assert run.should_execute
        run.result = "long"
    with service.once(keys.bounded(long_scope), "evt_1", "payout") as run:
        assert run.should_execute, "another scope's stored result was read"
        run.result = "spelled"
    assert service.lookup(long_scope, "evt_1").result == "long"  # type: ignore[union-attr]
    for scope in ("\ud800", "\udfff"):  # a lone surrogate: no database stores one
        with service.once(scope, "evt_1", "payout") as run:
            assert run.should_execute
            run.result = scope.encode("utf-8", "surrogatepass").hex()
    assert service.lookup("\ud800", "evt_1").result == "eda080"  # type: ignore[union-attr]
    assert service.lookup(keys.bounded(long_scope), "evt_1").result == "spelled"  # type: ignore[union-attr]


# -- amounts a float cannot tell apart --------------------------------------------------


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("12.345678901234567891", "12.345678901234567899"),
        ("12.50", "12.5"),
        ("1E+1", "10.0"),
    ],
)
def test_amounts_a_decimal_parser_reads_apart_are_two_requests(
    api: APIClient, key: str, one: str, two: str
) -> None:
    def send(amount: str, spacing: str = " ") -> Any:
        body = f'{{"amount":{spacing}{amount},{spacing}"currency": "EUR"}}'
        return api.post(
            "/decimal/", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
        )

    first = send(one)
    assert first.status_code == 201 and first.json()["amount"] == one
    assert send(one, spacing="\n  ")["Idempotent-Replayed"] == "true", "whitespace is no change"
    changed = send(two)
    assert changed.status_code == 422, "another amount got the first one's 201"
    assert changed.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1
