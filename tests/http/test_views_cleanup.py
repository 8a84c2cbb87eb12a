"""Sync and adrf async views under @idempotent: after each
request nothing of the work is left on the thread's connections, and a
handler calling another under the same key is one execution."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections
from django.test.utils import override_settings
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

from idempotency_app.decorators import idempotent
from idempotency_app.lifecycle import units, work
from tests.conftest import post
from tests.lifecycle.test_work_cleanup import scrub
from tests.testapp.models import AuditEntry, Charge

adrf = pytest.importorskip("adrf")
from adrf.decorators import api_view as async_api_view  # noqa: E402

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])
URLCONF = "tests.http.test_views_cleanup"
RUNS: list[str] = []


def _mine(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
    return execute(sql, params, many, context)


def steer(data: Any) -> None:
    if data.get("push_other"):
        with connections["other"].execute_wrapper(_mine):
            Charge.objects.create(label="in-wrapper")
            if data.get("raise_in_wrapper"):
                raise ValueError("card network down")
    if data.get("clear_other"):
        connections["other"].execute_wrappers.clear()
    if data.get("raise"):
        raise ValueError("card network down")


@api_view(["POST"])
@idempotent
def inner(request: Request) -> Response:
    RUNS.append("inner")
    Charge.objects.create(label="inner")
    return Response({"inner": True}, status=201)


@api_view(["POST"])
@idempotent
def outer(request: Request) -> Response:
    RUNS.append("outer")
    Charge.objects.create(label="outer")
    steer(request.data)
    return Response({"outer": True}, status=201)


@async_api_view(["POST"])
@idempotent
async def async_charge(request: Request) -> Response:
    RUNS.append("async")
    await Charge.objects.acreate(label="async")
    await sync_to_async(steer)(dict(request.data))
    return Response({"ok": True}, status=201)


class Nested(APIView):
    @idempotent
    def post(self, request: Request) -> Response:
        RUNS.append("post")
        Charge.objects.create(label="post")
        return self.put(request)

    @idempotent(methods=["POST", "PUT"])
    def put(self, request: Request) -> Response:
        RUNS.append("put")
        Charge.objects.create(label="put")
        if request.data.get("fail"):
            raise ValueError("inner failed")
        return Response({"ok": True}, status=201)


urlpatterns = [
    path("nested/", Nested.as_view()),
    path("outer/", outer),
    path("inner/", inner),
    path("async/", async_charge),
]


@pytest.fixture(autouse=True)
def _urls() -> Any:
    RUNS.clear()
    with override_settings(ROOT_URLCONF=URLCONF):
        yield
    scrub()


def clean() -> None:
    assert connection.execute_wrappers == []
    assert connections["other"].execute_wrappers == []
    assert "_savepoint" not in vars(connections["default"])
    assert "_savepoint_commit" not in vars(connections["default"])
    assert work._work.get() is None
    assert dict(units._running.get()) == {}


@pytest.mark.parametrize("url", ["/outer/", "/async/"])
@pytest.mark.parametrize(
    "data",
    [
        {},
        {"raise": True},
        {"push_other": True},
        {"push_other": True, "raise_in_wrapper": True},
    ],
    ids=["ok", "raises", "balanced-wrapper", "raises-in-wrapper"],
)
def test_nothing_left_after_the_request(
    quiet_api: APIClient, key: str, url: str, data: Any
) -> None:
    first = post(quiet_api, url, data, key)
    clean()
    again = post(quiet_api, url, data, key)
    clean()
    if first.status_code == 201:
        assert again["Idempotent-Replayed"] == "true"
        assert len(RUNS) == 1
    else:
        assert first.status_code == 500 and again.status_code == 500
        assert len(RUNS) == 2, "a failed run releases the key: the retry runs"
    AuditEntry.objects.using("other").create(note="after")


@pytest.mark.parametrize("url", ["/outer/", "/async/"])
def test_view_that_empties_another_databases_wrappers(
    quiet_api: APIClient, key: str, url: str
) -> None:
    """The view takes the guard off another database: refused, and nothing
    of the work is left on the thread."""
    refused = post(quiet_api, url, {"clear_other": True}, key)
    assert refused.status_code == 500
    assert Charge.objects.count() == 0
    assert connection.execute_wrappers == [], "the claim database's guard outlived the request"
    assert work._work.get() is None
    # the next request on this thread, under another key, still works
    response = post(quiet_api, url, {}, key + "-next")
    assert response.status_code == 201, response.content


@pytest.mark.parametrize("url", ["/outer/", "/async/"])
def test_after_a_view_that_empties_another_databases_wrappers_the_thread_still_serves(
    quiet_api: APIClient, key: str, url: str
) -> None:
    """What the stale guard does to the worker thread: every later request
    and every later query on the claim's database in it."""
    post(quiet_api, url, {"clear_other": True}, key)
    problems = []
    try:
        Charge.objects.count()
    except Exception as exc:
        problems.append(f"plain query after the request: {type(exc).__name__}")
    response = post(quiet_api, url, {}, key + "-next")
    if response.status_code != 201:
        problems.append(f"next request: {response.status_code} {response.content[:80]!r}")
    assert problems == []


@pytest.mark.parametrize("fail", [False, True])
def test_nested_handler_same_key(quiet_api: APIClient, key: str, fail: bool) -> None:
    """A view method calling another covered method for the same request
    (partial_update calling update): one execution, one record, and the
    running mark gone afterwards so the retry replays (or runs again)."""
    first = post(quiet_api, "/nested/", {"fail": fail}, key)
    clean()
    again = post(quiet_api, "/nested/", {"fail": fail}, key)
    clean()
    if fail:
        assert (first.status_code, again.status_code) == (500, 500)
        assert RUNS == ["post", "put", "post", "put"]
        assert Charge.objects.count() == 0
    else:
        assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
        assert RUNS == ["post", "put"]
        assert sorted(Charge.objects.values_list("label", flat=True)) == ["post", "put"]
