"""The views measured side by side, and one that says which library it runs.

``floor`` authenticates and returns; ``plain`` is a write view (two writes in
one transaction); ``urls.py`` serves the very same ``write`` under
``@idempotent`` as ``/idem/``, and ``peer_urls.py`` under drf-idempotency's
middleware. Nothing here imports ``idempotency_app`` at module level, so the
peer's server (which does not install it) serves these same functions.
A ``sleep`` in the body holds the transaction open between the two writes:
the conflict scenario uses it to keep a key in progress.
"""

from __future__ import annotations

import hashlib
import os
import time

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from benchmarks.benchproject.models import Charge, LedgerEntry


@api_view(["POST"])
def floor(request: Request) -> Response:
    """The worker's pid lets the load driver spread its connections evenly."""
    return Response({"ok": True, "worker": os.getpid()})


# What ``least_replay`` answered, by the digest of what was asked: status,
# headers and body, as a replay keeps them.
_ANSWERED: dict[bytes, tuple[int, tuple[tuple[str, str], ...], bytes]] = {}


@api_view(["POST"])
def least_replay(request: Request) -> HttpResponse:
    """The least a correct replay held in memory can do beyond ``floor``:
    read the body and hash it with the principal and the key (a key sent
    again with another body is another request, and must not get this
    answer), find the answer, and send its bytes and headers as they were,
    marked as a replay. The first request of a key stores an answer of the
    size the bench view gives. Stricter than the library (the body's bytes,
    not its JSON), which costs less, not more."""
    key = request.headers.get("Idempotency-Key", "")
    asked = hashlib.sha256(f"{request.user.pk}\n{key}\n".encode() + request.body).digest()
    answer = _ANSWERED.get(asked)
    if answer is None:
        headers = (("Content-Type", "application/json"), ("Idempotency-Expires", "never"))
        answer = _ANSWERED[asked] = (201, headers, b'{"id":1,"label":"bench","amount":100}')
    status, headers, body = answer
    response = HttpResponse(body, status=status)
    for name, value in headers:
        response[name] = value
    response["Idempotent-Replayed"] = "true"
    return response


def library(request: HttpRequest) -> JsonResponse:
    """Where this server imports ``idempotency_app`` from: an A/B run checks
    that each server measures the checkout it should."""
    import idempotency_app

    return JsonResponse({"path": os.path.realpath(idempotency_app.__file__), "pid": os.getpid()})


# micro.py switches it off to measure what the view's own savepoint costs
# inside the decorator's transaction.
SAVEPOINT = True


def write(request: Request) -> Response:
    data = request.data
    with transaction.atomic(savepoint=SAVEPOINT):
        charge = Charge.objects.create(
            label=str(data.get("label", "")), amount=int(data.get("amount", 0))
        )
        if data.get("sleep"):
            time.sleep(float(data["sleep"]))
        LedgerEntry.objects.create(charge=charge, amount=charge.amount)
    return Response({"id": charge.pk, "label": charge.label, "amount": charge.amount}, status=201)


plain = api_view(["POST"])(write)
