"""Through HTTP, sync and adrf async views: a RELEASE
the server refuses, dropped by a later ROLLBACK TO, must not turn into a
stored, replayed 201 (urls: this module)."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import transaction
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from idempotency_app.decorators import idempotent
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels, post
from tests.savepoints import savepoint
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]


def _refused_release_dropped() -> None:
    Charge.objects.create(label="w")
    outer = savepoint()
    inner = savepoint()
    with transaction.atomic():  # RELEASE refused: destroyed below
        Charge.objects.create(label="undone")
        transaction.savepoint_rollback(inner)
    transaction.savepoint_rollback(outer)


def _refused_release_kept() -> None:
    Charge.objects.create(label="w")
    sid = savepoint()
    with transaction.atomic():
        transaction.savepoint_rollback(sid)


def _ok() -> None:
    Charge.objects.create(label="ok")
    with transaction.atomic():
        Charge.objects.create(label="ok inner")


WORKS = {"dropped": _refused_release_dropped, "kept": _refused_release_kept, "ok": _ok}


@api_view(["POST"])
@idempotent
def sync_view(request: Request, work: str) -> Response:
    WORKS[work]()
    return Response({"ok": True}, status=201)


urlpatterns = [path("sync/<str:work>/", sync_view)]

if find_spec("adrf") is not None:
    from adrf.decorators import api_view as async_api_view

    @async_api_view(["POST"])
    @idempotent
    async def async_view(request: Request, work: str) -> Response:
        await sync_to_async(WORKS[work])()
        return Response({"ok": True}, status=201)

    urlpatterns.append(path("async/<str:work>/", async_view))


KINDS = [
    "sync",
    pytest.param("async", marks=pytest.mark.skipif(find_spec("adrf") is None, reason="adrf")),
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_plain_success_commits_once_and_replays(quiet_api: Any, key: str, kind: str) -> None:
    first = post(quiet_api, f"/{kind}/ok/", {}, key)
    assert first.status_code == 201
    again = post(quiet_api, f"/{kind}/ok/", {}, key)
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert labels() == ["ok", "ok inner"]


@pytest.mark.parametrize("work", ["kept", "dropped"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_release_is_a_500_and_nothing_is_kept(
    quiet_api: Any, key: str, kind: str, work: str
) -> None:
    response = post(quiet_api, f"/{kind}/{work}/", {}, key)
    assert response.status_code == 500, (response.status_code, labels())
    assert labels() == []
    assert not IdempotencyRecord.objects.filter(key=key, status="completed").exists()
    again = post(quiet_api, f"/{kind}/{work}/", {}, key)
    assert "Idempotent-Replayed" not in again
