"""Header values that only the standard library writes as it does (DEL, a
Latin-1 letter, control characters, quotes and backslashes), stored by a
real view and replayed on every database: what the client got the first
time, header by header, and the column the very text the standard library
writes. A row written by older code (the standard library's text) replays
the same."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test.utils import override_settings
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from idempotency_app.decorators import idempotent
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store.base import parse_headers
from tests.conftest import post
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

STANDARD = json.JSONEncoder(separators=(",", ":")).encode
VALUES = ["a\x7fb", "caf\u00e9", "\x01\x1f\t", "\\ \" / ' %s", "", "\u00ff\u0080"]


@api_view(["POST"])
@idempotent()
def odd_headers(request: Request) -> Response:
    Charge.objects.create(label="odd headers")
    response = Response({"ok": True}, status=201)
    for name, value in request.data["headers"]:
        response[name] = value
    return response


urlpatterns = [path("odd-headers/", odd_headers)]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_odd_header_values_replay_as_first_sent(api: Any, key: str, value: str) -> None:
    headers = [["Content-Disposition", value], ["X-Odd", value]]
    with override_settings(IDEMPOTENCY={"STORE_HEADERS": ["X-Odd"]}):
        first = post(api, "/odd-headers/", {"headers": headers}, key)
        assert first.status_code == 201
        column = IdempotencyRecord.objects.get(key=key).response_headers
        assert column == STANDARD([list(pair) for pair in parse_headers(column)])
        replay = post(api, "/odd-headers/", {"headers": headers}, key)
    assert replay["Idempotent-Replayed"] == "true"
    for name in ("Content-Disposition", "X-Odd", "Content-Type"):
        assert replay[name] == first[name]
    assert replay.content == first.content
    assert Charge.objects.count() == 1


def test_a_row_written_by_the_standard_library_replays_the_same(api: Any, key: str) -> None:
    headers = [["Content-Disposition", "a\x7fb"], ["X-Odd", "\x7f\u00e9"]]
    with override_settings(IDEMPOTENCY={"STORE_HEADERS": ["X-Odd"]}):
        first = post(api, "/odd-headers/", {"headers": headers}, key)
        row = IdempotencyRecord.objects.filter(key=key)
        pairs = parse_headers(row.get().response_headers)
        row.update(response_headers=json.dumps([list(pair) for pair in pairs]))  # spaced, escaped
        replay = post(api, "/odd-headers/", {"headers": headers}, key)
    assert replay["Idempotent-Replayed"] == "true"
    for name in ("Content-Disposition", "X-Odd", "Content-Type"):
        assert replay[name] == first[name]
