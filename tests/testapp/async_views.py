"""adrf async views under the decorator and the mixin, steered like
``tests.testapp.views`` by the body: ``sleep`` (seconds to await between
the two writes), ``respond`` (a status to return), ``raise`` (an exception
to raise), ``label`` and ``amount``. Imported only where adrf is installed."""

from __future__ import annotations

import asyncio
from typing import Any

from adrf.decorators import api_view
from adrf.views import APIView
from adrf.viewsets import ViewSet
from django.db import IntegrityError
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from idempotency_app.decorators import idempotent
from idempotency_app.mixins import IdempotentMixin
from tests.testapp.models import AuditEntry, Charge, LedgerEntry, Tag
from tests.testapp.views import RAISES


async def do_charge(request: Request, **url_kwargs: Any) -> Response:
    data = request.data if isinstance(request.data, dict) else {}
    if "raise" in data:
        raise RAISES[data["raise"]]
    charge = await Charge.objects.acreate(
        label=str(data.get("label", "")), amount=int(data.get("amount", 0))
    )
    if data.get("sleep"):
        await asyncio.sleep(float(data["sleep"]))
    await LedgerEntry.objects.acreate(charge=charge, amount=charge.amount)
    code = int(data.get("respond", status.HTTP_201_CREATED))
    body = {"id": charge.id, "label": charge.label, "amount": charge.amount, **url_kwargs}
    return Response(body, status=code, headers={"Location": f"/charges/{charge.id}/"})


@api_view(["POST"])
@idempotent
async def charge_fn(request: Request) -> Response:
    return await do_charge(request)


@api_view(["POST"])
async def plain_charge_fn(request: Request) -> Response:
    """Not idempotent: the baseline the benchmarks compare against."""
    return await do_charge(request)


@api_view(["POST"])
@idempotent(required=True)
async def charge_required_fn(request: Request) -> Response:
    return await do_charge(request)


@api_view(["POST"])
@idempotent
async def tag_if_new(request: Request) -> Response:
    """'Already exists, fine' without an atomic() of its own: the caught
    error dooms the unit's transaction, so this is no success."""
    charge = await Charge.objects.acreate(label="tagged")
    try:  # noqa: SIM105 (written as integrators write it)
        await Tag.objects.acreate(name=request.data["tag"])
    except IntegrityError:
        pass
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
async def writes_to_other_database(request: Request) -> Response:
    charge = await Charge.objects.acreate(label="audited")
    await AuditEntry.objects.using("other").acreate(note=f"charge {charge.pk}")
    return Response({"charge": charge.pk}, status=201)


class ChargeView(APIView):
    @idempotent
    async def post(self, request: Request, account: int) -> Response:
        return await do_charge(request, account=account)


class MixinChargeView(IdempotentMixin, APIView):
    async def post(self, request: Request) -> Response:
        return await do_charge(request)

    async def get(self, request: Request) -> Response:
        return Response({"count": await Charge.objects.acount()})


class ChargeViewSet(IdempotentMixin, ViewSet):
    async def create(self, request: Request) -> Response:
        return await do_charge(request)

    @idempotent(ttl=120)
    async def partial_update(self, request: Request, pk: str) -> Response:
        return await do_charge(request, pk=pk)
