"""Three ways to make an endpoint idempotent, one per resource."""

from __future__ import annotations

import time

from django.conf import settings
from django.db.models import F, ProtectedError, QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import status, viewsets
from rest_framework.decorators import api_view
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from example_project.payments.models import Account, Charge
from example_project.payments.serializers import (
    AccountSerializer,
    ChargeSerializer,
    RefundSerializer,
)
from idempotency_app import IdempotentMixin, idempotent


class AccountInUse(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "account_in_use"
    default_detail = "This account has payments, so it is kept."


@extend_schema_view(
    destroy=extend_schema(
        responses={204: None, 409: OpenApiResponse(description=AccountInUse.default_detail)}
    )
)
class AccountViewSet(IdempotentMixin, viewsets.ModelViewSet[Account]):
    """The mixin covers POST and PATCH (creating and renaming accounts)."""

    serializer_class = AccountSerializer

    def get_queryset(self) -> QuerySet[Account]:
        if getattr(self, "swagger_fake_view", False):  # the schema is being generated
            return Account.objects.none()
        return Account.objects.filter(owner=self.request.user)

    def perform_create(self, serializer: AccountSerializer) -> None:  # type: ignore[override]
        serializer.save(owner=self.request.user)

    def perform_destroy(self, instance: Account) -> None:
        """Money history is never deleted: an account with payments stays."""
        try:
            instance.delete()
        except ProtectedError as exc:
            raise AccountInUse() from exc


MAX_SIMULATED_DELAY = 30


def simulated_delay(request: Request) -> float:
    """Seconds asked for by ``?simulate_delay=`` (honoured with DEBUG on only)."""
    raw = request.query_params.get("simulate_delay")
    if not settings.DEBUG or raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_SIMULATED_DELAY:  # also refuses nan
        raise ValidationError(
            {"simulate_delay": [f"A number of seconds from 0 to {MAX_SIMULATED_DELAY}."]}
        )
    return seconds


@extend_schema(request=ChargeSerializer, responses={201: ChargeSerializer})
@api_view(["POST"])
@idempotent(required=True)
def create_charge(request: Request, account_id: int) -> Response:
    """Charging money requires a key: a retry must never charge twice.

    With DEBUG on, ``?simulate_delay=SECONDS`` makes the charge slow, to see
    what a concurrent duplicate gets (409, or a replay with WAIT_FOR_IN_FLIGHT).
    """
    account = get_object_or_404(Account, pk=account_id, owner=request.user)
    time.sleep(simulated_delay(request))
    serializer = ChargeSerializer(data=request.data)
    serializer.is_valid(raise_exception=True)
    charge = serializer.save(account=account)
    Account.objects.filter(pk=account.pk).update(balance=F("balance") - charge.amount)
    return Response(
        ChargeSerializer(charge).data,
        status=status.HTTP_201_CREATED,
        headers={"Location": f"/api/charges/{charge.pk}/"},
    )


class RefundView(APIView):
    @extend_schema(request=RefundSerializer, responses={201: RefundSerializer})
    @idempotent(ttl=7 * 24 * 3600)
    def post(self, request: Request, charge_id: int) -> Response:
        charge = get_object_or_404(Charge, pk=charge_id, account__owner=request.user)
        serializer = RefundSerializer(data=request.data, context={"charge": charge})
        serializer.is_valid(raise_exception=True)
        refund = serializer.save(charge=charge)
        Account.objects.filter(pk=charge.account_id).update(balance=F("balance") + refund.amount)
        return Response(RefundSerializer(refund).data, status=status.HTTP_201_CREATED)
