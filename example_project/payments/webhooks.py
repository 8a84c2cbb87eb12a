"""Webhooks from payment providers: each event is processed once, however
many times the provider delivers it.

Providers deliver at least once and redeliver on anything but a 2xx, so the
provider's event id is the idempotency key, in the scope
``provider:<name>``. The receiver (``once()``) and the batch command
(``process_event``, the decorated function) share the scope, key and
operation, so an event that arrives by both ways still runs once.

Mounted by ``path("webhooks/", include("example_project.payments.webhooks"))``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from django.db.models import F
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from example_project.payments.models import Account, ProviderPayment
from example_project.payments.tasks import send_receipt
from idempotency_app import service
from idempotency_app.service.enqueue import enqueue_once

# Signing secrets by provider; the example's default is for local use only.
PROVIDERS = {"acme": os.environ.get("EXAMPLE_ACME_WEBHOOK_SECRET", "acme-example-secret")}
SIGNATURE_HEADER = "X-Signature"
OPERATION = "payments.provider_event"
# A copy delivered while the first is still running waits this long for its
# result instead of getting a 409.
WAIT_FOR_FIRST = 5


def scope_for(provider: str) -> str:
    return f"provider:{provider}"


def facts(event: dict[str, Any]) -> Any:
    """What the event asks for. Not the whole envelope: providers change
    delivery fields (attempt counts, timestamps) between copies."""
    return [event.get("type"), event.get("data")]


def sign(provider: str, body: bytes) -> str:
    digest = hmac.new(PROVIDERS[provider].encode(), body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def apply_event(provider: str, event: dict[str, Any]) -> dict[str, Any]:
    """The work for one event, without idempotency: it runs in the
    transaction that also stores its result. Events that can never succeed
    are answered (and stored) too, so the provider stops redelivering them."""
    if event.get("type") != "payment.received":
        return {"status": "ignored", "reason": f"unhandled type {event.get('type')!r}"}
    data = event.get("data")
    if not isinstance(data, dict):
        data = {}
    account_id, amount = data.get("account"), data.get("amount")
    account = Account.objects.filter(pk=account_id).first() if type(account_id) is int else None
    if account is None or type(amount) is not int or amount <= 0:
        return {"status": "rejected", "reason": "unknown account or invalid amount"}
    payment = ProviderPayment.objects.create(
        account=account, provider=provider, event_id=str(event["id"]), amount=amount
    )
    Account.objects.filter(pk=account.pk).update(balance=F("balance") + amount)
    # Enqueued in this transaction: with the database task backend the task
    # row commits with the credit, once per event however often it arrives.
    enqueue_once(send_receipt, payment.pk, key=f"{provider}:{event['id']}", scope="receipts")
    return {"status": "credited", "payment": payment.pk, "account": account.pk, "amount": amount}


@service.idempotent_task(
    scope=lambda provider, event: scope_for(provider),
    key=lambda provider, event: event["id"],
    fingerprint=lambda provider, event: facts(event),
    operation=OPERATION,
)
def process_event(provider: str, event: dict[str, Any]) -> dict[str, Any]:
    """For batches and task queues: ``apply_event`` once per event id."""
    return apply_event(provider, event)


def parse_event(body: bytes | str) -> dict[str, Any] | None:
    try:
        event = json.loads(body)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    event_id = event.get("id")
    # The limits of a service key: 1 to 255 characters, no NUL.
    if not isinstance(event_id, str) or not 0 < len(event_id) <= 255 or "\x00" in event_id:
        return None
    return event


@csrf_exempt
@require_POST
def receive(request: HttpRequest, provider: str) -> JsonResponse:
    if provider not in PROVIDERS:
        return JsonResponse({"detail": f"Unknown provider {provider!r}."}, status=404)
    signature = request.headers.get(SIGNATURE_HEADER, "")
    if not hmac.compare_digest(signature, sign(provider, request.body)):
        return JsonResponse({"detail": "Invalid signature."}, status=400)
    event = parse_event(request.body)
    if event is None:
        return JsonResponse({"detail": "Expected a JSON event with a string id."}, status=400)
    try:
        with service.once(
            scope_for(provider), event["id"], OPERATION, facts(event), wait=WAIT_FOR_FIRST
        ) as run:
            if run.should_execute:
                run.result = apply_event(provider, event)
    except service.KeyInProgress as exc:
        response = JsonResponse({"detail": "Still processing this event; retry."}, status=409)
        response["Retry-After"] = str(exc.retry_after)
        return response
    except service.KeyReused:
        detail = "This event id was already delivered with different contents."
        return JsonResponse({"detail": detail}, status=422)
    except service.StoreUnavailable:
        return JsonResponse({"detail": "Temporarily unavailable; retry."}, status=503)
    return JsonResponse({"event": event["id"], "result": run.result, "replayed": run.replayed})


urlpatterns = [path("<slug:provider>/", receive, name="provider-webhook")]
