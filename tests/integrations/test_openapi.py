"""The drf-spectacular extension: what each idempotent operation documents,
with no per-view work, in each error format."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test.utils import override_settings
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.utils import extend_schema
from drf_spectacular.validation import validate_schema
from hypothesis import given, strategies as st
from rest_framework import serializers, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView

from idempotency_app.decorators import idempotent
from idempotency_app.http import keys
from idempotency_app.integrations.openapi import KEY_PATTERN, covering_options
from idempotency_app.mixins import IdempotentMixin


class ItemSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()


@extend_schema(request=ItemSerializer, responses={201: ItemSerializer})
@api_view(["POST"])
@idempotent(required=True)
def required_fn(request: Request) -> Response:
    return Response({"name": "x"}, status=201)


@extend_schema(request=ItemSerializer, responses={201: ItemSerializer})
@api_view(["POST"])
def plain_fn(request: Request) -> Response:
    return Response({"name": "x"}, status=201)


class MixinView(IdempotentMixin, APIView):
    @extend_schema(responses={200: ItemSerializer})
    def get(self, request: Request) -> Response:
        return Response({"name": "x"})

    @extend_schema(request=ItemSerializer, responses={201: ItemSerializer})
    def post(self, request: Request) -> Response:
        return Response({"name": "x"}, status=201)

    @extend_schema(request=ItemSerializer, responses={200: ItemSerializer})
    def put(self, request: Request) -> Response:  # PUT is not in METHODS
        return Response({"name": "x"})


class NarrowView(APIView):
    @extend_schema(
        request=ItemSerializer,
        responses={201: ItemSerializer, 400: {"type": "object", "properties": {"name": {}}}},
    )
    @idempotent(methods=["PATCH"])  # not POST: documents nothing there
    def post(self, request: Request) -> Response:
        return Response({"name": "x"}, status=201)

    @extend_schema(
        request=ItemSerializer,
        responses={200: ItemSerializer, 400: {"type": "object", "properties": {"name": {}}}},
    )
    @idempotent
    def patch(self, request: Request) -> Response:
        return Response({"name": "x"})


class ItemViewSet(viewsets.GenericViewSet[Any]):
    serializer_class = ItemSerializer

    @extend_schema(responses={201: ItemSerializer})
    @action(detail=False, methods=["post"])
    @idempotent
    def archive(self, request: Request) -> Response:
        return Response({"name": "x"}, status=201)


router = SimpleRouter()
router.register("items", ItemViewSet, basename="item")
urlpatterns = [
    path("required/", required_fn),
    path("plain/", plain_fn),
    path("mixin/", MixinView.as_view()),
    path("narrow/", NarrowView.as_view()),
    *router.urls,
]

REST = {"DEFAULT_SCHEMA_CLASS": "idempotency_app.openapi.AutoSchema"}  # as in tests.settings


def schema(**idempotency: Any) -> dict[str, Any]:
    with override_settings(IDEMPOTENCY=idempotency):
        generated: dict[str, Any] = SchemaGenerator(
            urlconf="tests.integrations.test_openapi"
        ).get_schema(request=None, public=True)
    validate_schema(generated)
    return generated


@pytest.fixture(scope="module")
def default() -> dict[str, Any]:
    return schema()


def key_header(operation: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (p for p in operation.get("parameters", []) if p["name"] == "Idempotency-Key"), None
    )


def test_a_required_key_is_documented_with_its_format(default: dict[str, Any]) -> None:
    header = key_header(default["paths"]["/required/"]["post"])
    assert header is not None
    assert header["in"] == "header" and header["required"] is True
    assert header["schema"] == {
        "type": "string",
        "minLength": 1,
        "maxLength": 255,
        "pattern": KEY_PATTERN,
    }
    assert header["description"].startswith("Required.")


def test_each_answer_of_the_layer_is_documented(default: dict[str, Any]) -> None:
    responses = default["paths"]["/required/"]["post"]["responses"]
    assert sorted(responses) == ["201", "400", "406", "409", "422", "500", "503"]
    schemas = default["components"]["schemas"]
    for status, name, code in [
        ("400", "IdempotencyKeyError", "idempotency_key_missing"),
        ("406", "IdempotencyReplayNotAcceptable", "idempotency_replay_not_acceptable"),
        ("409", "IdempotencyRequestInProgress", "request_in_progress"),
        ("422", "IdempotencyKeyReused", "idempotency_key_reused"),
        ("500", "IdempotencyRequestRolledBack", "request_rolled_back"),
        ("500", "IdempotencyRequestRolledBack", "request_outcome_unknown"),
        ("503", "IdempotencyStoreUnavailable", "idempotency_store_unavailable"),
    ]:
        content = responses[status]["content"]["application/json"]
        assert content["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert f"`{code}`" in responses[status]["description"]
        assert schemas[name]["required"] == ["detail", "code"]
        assert code in enum_of(default, schemas[name]["properties"]["code"])
    for status in ("409", "503"):
        retry_after = responses[status]["headers"]["Retry-After"]
        assert retry_after["required"] is True and retry_after["schema"]["type"] == "integer"


def enum_of(generated: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """drf-spectacular moves enums into components of their own."""
    schema = schema.get("allOf", [schema])[0]
    if "$ref" in schema:
        schema = generated["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return list(schema["enum"])


def test_the_views_own_responses_carry_the_replay_headers(default: dict[str, Any]) -> None:
    created = default["paths"]["/required/"]["post"]["responses"]["201"]
    assert created["headers"] == {
        "Idempotent-Replayed": {"$ref": "#/components/headers/IdempotentReplayed"},
        "Idempotency-Expires": {"$ref": "#/components/headers/IdempotencyExpires"},
        "Idempotent-Body-Omitted": {"$ref": "#/components/headers/IdempotentBodyOmitted"},
    }
    replayed = default["components"]["headers"]["IdempotentReplayed"]
    assert replayed["schema"] == {"type": "string", "enum": ["true"]}


def test_the_mixin_documents_the_methods_it_covers(default: dict[str, Any]) -> None:
    mixin = default["paths"]["/mixin/"]
    header = key_header(mixin["post"])
    assert header is not None and not header.get("required", False)
    assert header["description"].startswith("Optional.")
    assert "409" in mixin["post"]["responses"]
    for method in ("get", "put"):
        assert key_header(mixin[method]) is None
        assert "409" not in mixin[method]["responses"]
        assert "headers" not in mixin[method]["responses"]["200"]


def test_viewset_actions_and_narrowed_methods(default: dict[str, Any]) -> None:
    assert key_header(default["paths"]["/items/archive/"]["post"]) is not None
    assert key_header(default["paths"]["/narrow/"]["post"]) is None
    assert key_header(default["paths"]["/narrow/"]["patch"]) is not None
    assert key_header(default["paths"]["/plain/"]["post"]) is None
    assert sorted(default["paths"]["/plain/"]["post"]["responses"]) == ["201"]


def test_a_status_the_view_documents_offers_both_bodies(default: dict[str, Any]) -> None:
    bad = default["paths"]["/narrow/"]["patch"]["responses"]["400"]
    alternatives = bad["content"]["application/json"]["schema"]["anyOf"]
    assert alternatives[1] == {"$ref": "#/components/schemas/IdempotencyKeyError"}
    assert alternatives[0]["properties"] == {"name": {}}
    # A 400 is replayed from the retry-storm guard, never stored.
    assert "Idempotent-Replayed" in bad["headers"] and "Idempotency-Expires" not in bad["headers"]


def test_problem_details_are_documented_as_such() -> None:
    generated = schema(ERROR_FORMAT="problem", PROBLEM_TYPE_BASE="https://api.example.com/p/")
    conflict = generated["paths"]["/required/"]["post"]["responses"]["409"]
    assert list(conflict["content"]) == ["application/problem+json"]
    problem = generated["components"]["schemas"]["IdempotencyRequestInProgressProblem"]
    assert problem["required"] == ["type", "title", "status", "detail", "code"]
    assert enum_of(generated, problem["properties"]["type"]) == [
        "https://api.example.com/p/request_in_progress"
    ]


def test_the_handler_format_follows_the_exception_handler() -> None:
    generated = schema(ERROR_FORMAT="handler")
    detail = generated["components"]["schemas"]["IdempotencyKeyReusedDetail"]
    assert detail["required"] == ["detail"]
    with override_settings(
        REST_FRAMEWORK={
            **REST,
            "EXCEPTION_HANDLER": "drf_standardized_errors.handler.exception_handler",
        },
        IDEMPOTENCY={"ERROR_FORMAT": "handler"},
    ):
        generated = SchemaGenerator(urlconf="tests.integrations.test_openapi").get_schema(
            None, True
        )
    validate_schema(generated)
    standardized = generated["components"]["schemas"][
        "IdempotencyRequestRolledBackStandardizedError"
    ]
    assert enum_of(generated, standardized["properties"]["type"]) == ["server_error"]
    error = standardized["properties"]["errors"]["items"]
    assert enum_of(generated, error["properties"]["code"]) == [
        "request_rolled_back",
        "request_outcome_unknown",
    ]


def test_a_disabled_layer_documents_nothing() -> None:
    generated = schema(ENABLED=False)
    assert key_header(generated["paths"]["/required/"]["post"]) is None
    assert "IdempotencyKeyError" not in generated["components"].get("schemas", {})


def test_covering_options_reads_the_handlers_options() -> None:
    view = NarrowView()
    options = covering_options(view, "patch")
    assert options is NarrowView.patch.idempotency_options  # type: ignore[attr-defined]
    assert covering_options(view, "post") is None
    assert covering_options(view, "get") is None


@given(st.from_regex(re.compile(KEY_PATTERN), fullmatch=True))
def test_every_key_the_schema_allows_is_accepted_as_it_is(value: str) -> None:
    assert keys.parse_key(value) == value
