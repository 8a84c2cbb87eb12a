"""Idempotent handlers served without DRF: check E030 must refuse them."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from django.urls import path
from django.views import View

from idempotency_app.decorators import idempotent


@idempotent
async def plain_async_view(request: Any) -> HttpResponse:
    return HttpResponse()


@idempotent
def plain_sync_view(request: Any) -> HttpResponse:
    return HttpResponse()


class PlainView(View):
    @idempotent
    async def post(self, request: Any) -> HttpResponse:
        return HttpResponse()


urlpatterns = [
    path("async/", plain_async_view),
    path("sync/", plain_sync_view),
    path("class/", PlainView.as_view()),
]
