"""Views that exercise every outcome. The request body steers them:
``sleep`` (seconds to wait between the two writes), ``respond`` (a status
to return), ``raise`` (an exception to raise), ``label`` and ``amount``."""

from __future__ import annotations

import time
from typing import Any

from django.http import Http404, StreamingHttpResponse
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action, api_view, permission_classes, throttle_classes
from rest_framework.exceptions import ParseError, PermissionDenied, ValidationError
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import ScopedRateThrottle
from rest_framework.views import APIView

from idempotency_app.decorators import idempotent
from idempotency_app.mixins import IdempotentMixin
from tests.testapp.models import Charge, LedgerEntry

RAISES: dict[str, Exception] = {
    "validation": ValidationError({"amount": ["Must be positive."]}),
    "parse": ParseError("Malformed."),
    "not_found": Http404("No such account."),
    "forbidden": PermissionDenied("Card declined."),
    "crash": RuntimeError("boom"),
}


def do_charge(request: Request, **url_kwargs: Any) -> Response:
    data = request.data if isinstance(request.data, dict) else {}
    if "raise" in data:
        raise RAISES[data["raise"]]
    charge = Charge.objects.create(
        label=str(data.get("label", "")), amount=int(data.get("amount", 0))
    )
    if data.get("sleep"):
        time.sleep(float(data["sleep"]))
    LedgerEntry.objects.create(charge=charge, amount=charge.amount)
    code = int(data.get("respond", status.HTTP_201_CREATED))
    body = {"id": charge.id, "label": charge.label, "amount": charge.amount, **url_kwargs}
    return Response(body, status=code, headers={"Location": f"/charges/{charge.id}/"})


@api_view(["POST"])
@idempotent
def charge_fn(request: Request) -> Response:
    return do_charge(request)


@api_view(["POST"])
@idempotent(required=True)
def charge_required_fn(request: Request) -> Response:
    return do_charge(request)


@api_view(["POST"])
@permission_classes([AllowAny])
@idempotent
def charge_anonymous_fn(request: Request) -> Response:
    return do_charge(request)


@api_view(["POST"])
@throttle_classes([ScopedRateThrottle])
@idempotent
def charge_throttled_fn(request: Request) -> Response:
    return do_charge(request)


charge_throttled_fn.cls.throttle_scope = "burst"  # type: ignore[attr-defined]


@api_view(["POST"])
@idempotent
def charge_with_cookie_fn(request: Request) -> Response:
    response = do_charge(request)
    response.set_cookie("session", "secret")
    response["Authorization"] = "Bearer leaked"
    response["X-Trace"] = "abc"
    return response


@api_view(["POST"])
@idempotent
def stream_fn(request: Request) -> StreamingHttpResponse:
    Charge.objects.create(label="stream")
    return StreamingHttpResponse(
        (b"chunk" for _ in range(3)), content_type="text/plain", status=201
    )


class AccountChargeView(APIView):
    @idempotent
    def post(self, request: Request, account: int) -> Response:
        return do_charge(request, account=account)


class MixinChargeView(IdempotentMixin, APIView):
    def post(self, request: Request) -> Response:
        return do_charge(request)

    def patch(self, request: Request) -> Response:
        return do_charge(request)

    def put(self, request: Request) -> Response:
        return do_charge(request)


class ChargeSerializer(serializers.ModelSerializer[Charge]):
    class Meta:
        model = Charge
        fields = ["id", "label", "amount"]

    def validate_amount(self, value: int) -> int:
        if value <= 0:
            raise serializers.ValidationError("Must be positive.")
        return value


class ChargeViewSet(IdempotentMixin, viewsets.ModelViewSet[Charge]):
    queryset = Charge.objects.all()
    serializer_class = ChargeSerializer

    @action(detail=True, methods=["post"])
    @idempotent
    def refund(self, request: Request, pk: str) -> Response:
        charge = self.get_object()
        refund = Charge.objects.create(label=f"refund of {charge.pk}", amount=-charge.amount)
        return Response({"id": refund.pk, "amount": refund.amount}, status=201)
