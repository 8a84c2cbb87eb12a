"""What the library relies on that Django, DRF or a driver does not promise,
each one listed in CONTRIBUTING.md ("Internals we rely on"). If one of these
fails, a release changed it: the feature named in the message needs a new
way in, before anything else."""

from __future__ import annotations

import inspect

import pytest
from django.db import connection, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import Atomic
from django.test import RequestFactory
from rest_framework.request import Request


def test_atomic_asks_the_enclosing_block_about_durable_ones() -> None:
    source = inspect.getsource(Atomic.__enter__)
    assert "durable" in source and "_from_testcase" in source, (
        "Atomic.__enter__ no longer reads the enclosing block's _from_testcase: "
        "lifecycle.work.UnitAtomic can no longer refuse atomic(durable=True) inside the work"
    )


@pytest.mark.django_db(transaction=True)
def test_a_connection_keeps_its_atomic_blocks_and_its_commit_hooks_flag() -> None:
    assert hasattr(connection, "run_commit_hooks_on_set_autocommit_on"), (
        "the connection no longer says its on_commit hooks are running: "
        "lifecycle.units cannot tell a failed hook from a failed commit"
    )
    with transaction.atomic():
        outer = connection.atomic_blocks[0]
        with transaction.atomic():
            assert connection.atomic_blocks[0] is outer, (
                "the connection no longer lists its atomic blocks: a NestedClaim cannot tell "
                "when the caller's transaction has ended (renew() of a nested claim)"
            )
    assert connection.atomic_blocks == []
    source = inspect.getsource(BaseDatabaseWrapper.set_autocommit)
    assert "run_commit_hooks_on_set_autocommit_on" in source, (
        "set_autocommit no longer clears the flag once the hooks have run"
    )


def test_a_request_keeps_its_stream_until_it_is_read() -> None:
    request = RequestFactory().post("/", b"x" * 10, content_type="application/octet-stream")
    assert hasattr(request, "_stream") and request._read_started is False, (
        "HttpRequest no longer keeps _stream and _read_started: http.keys cannot hash a raw "
        "body over DATA_UPLOAD_MAX_MEMORY_SIZE as it streams and hand it back to the parsers"
    )
    drf = Request(request)
    assert drf._request is request, "DRF's Request no longer wraps the HttpRequest as _request"


def test_drfs_api_view_names_its_view_class_after_the_function() -> None:
    from rest_framework.decorators import api_view
    from rest_framework.response import Response

    @api_view(["POST"])
    def make_charge(request: Request) -> Response:
        return Response()

    view_class = make_charge.cls  # type: ignore[attr-defined]
    assert (view_class.__module__, view_class.__name__) == (__name__, "make_charge"), (
        "@api_view no longer names its view class after the function: the OpenAPI schema "
        "cannot find an @idempotent function view's options"
    )


def test_drfs_test_client_keeps_its_credentials() -> None:
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token x")
    assert client._credentials == {"HTTP_AUTHORIZATION": "Token x"}, (
        "APIClient no longer keeps credentials() in _credentials: assert_idempotent's "
        "concurrent clients cannot send the caller's credentials"
    )


def test_spectaculars_schema_builds_response_bodies_in_one_method() -> None:
    openapi = pytest.importorskip("drf_spectacular.openapi", reason="needs drf-spectacular")
    assert callable(getattr(openapi.AutoSchema, "_get_response_bodies", None)), (
        "drf-spectacular's AutoSchema no longer has _get_response_bodies: the OpenAPI "
        "extension cannot add the protocol's answers next to a view's own"
    )
