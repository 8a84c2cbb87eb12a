"""A payments team's charge view: a charge and its ledger entry in
``atomic()``, the charge locked with ``select_for_update``, a duplicate tag
caught inside a nested block, a webhook queued with ``on_commit``, and a
response body of the size asked for (up to past 64 KB)."""

from django.db import IntegrityError, transaction
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.response import Response

from idempotency_app.decorators import idempotent
from tests.testapp.models import Charge, LedgerEntry, Tag

WEBHOOKS: list[str] = []


@api_view(["POST"])
@idempotent
def pay(request):
    data = request.data
    size = int(data.get("size", 0))
    with transaction.atomic():
        charge = Charge.objects.create(
            label=str(data.get("label", "")), amount=int(data.get("amount", 1))
        )
        Charge.objects.select_for_update().get(pk=charge.pk)
        LedgerEntry.objects.create(charge=charge, amount=charge.amount)
    try:
        with transaction.atomic():
            Tag.objects.create(name=str(data.get("tag", "t")))
    except IntegrityError:
        pass
    label = charge.label
    transaction.on_commit(lambda: WEBHOOKS.append(label))
    fill = (label[:1] or "x") * size
    return Response({"id": charge.id, "label": label, "fill": fill}, status=201)


urlpatterns = [path("pay/", pay)]
