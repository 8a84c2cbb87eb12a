"""The async endpoint: a charge through an adrf async view, served as well by
uvicorn (``uvicorn example_project.asgi:application``) as by runserver.

The same contract as ``views.create_charge``: a key is required, a retry
replays, a concurrent duplicate gets 409. The awaited ORM calls run inside
the transaction that stores the response (docs/async.md).
"""

from __future__ import annotations

import asyncio

from adrf.decorators import api_view
from django.db.models import F
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from example_project.payments.models import Account, Charge
from example_project.payments.serializers import ChargeSerializer
from example_project.payments.views import simulated_delay
from idempotency_app import idempotent


@extend_schema(request=ChargeSerializer, responses={201: ChargeSerializer})
@api_view(["POST"])
@idempotent(required=True)
async def create_charge_async(request: Request, account_id: int) -> Response:
    """``create_charge`` as an async view; ``?simulate_delay=`` awaits (DEBUG only)."""
    account = await Account.objects.filter(pk=account_id, owner=request.user).afirst()
    if account is None:
        raise NotFound("No such account.")
    await asyncio.sleep(simulated_delay(request))
    serializer = ChargeSerializer(data=request.data)
    serializer.is_valid(raise_exception=True)
    charge = await Charge.objects.acreate(account=account, **serializer.validated_data)
    await Account.objects.filter(pk=account.pk).aupdate(balance=F("balance") - charge.amount)
    return Response(
        ChargeSerializer(charge).data,
        status=status.HTTP_201_CREATED,
        headers={"Location": f"/api/charges/{charge.pk}/"},
    )
