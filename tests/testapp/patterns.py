"""Views written the way Django teams write them. Each is a pattern under
which the library must keep its promise: a success only for work that
committed, once. The request body steers them like ``views.py``'s."""

from __future__ import annotations

import hashlib
from typing import Any

from django.db import IntegrityError, transaction
from django.http import HttpResponse
from rest_framework import viewsets
from rest_framework.decorators import api_view
from rest_framework.exceptions import APIException
from rest_framework.parsers import FileUploadParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView, exception_handler

from idempotency_app.decorators import idempotent
from idempotency_app.mixins import IdempotentMixin
from tests.testapp.models import AuditEntry, Charge, LedgerEntry, Tag
from tests.testapp.views import ChargeSerializer

# What on_commit hooks saw, for the tests to read.
HOOK_CALLS: list[int] = []


def _charge(request: Request, label: str = "") -> Charge:
    return Charge.objects.create(label=label or str(request.data.get("label", "")), amount=1)


@api_view(["POST"])
@idempotent
def tag_if_new(request: Request) -> Response:
    """'Already exists, fine' with no atomic() of its own: under a key the
    caught error dooms the transaction the view runs in."""
    charge = _charge(request)
    try:  # noqa: SIM105 (written as integrators write it)
        Tag.objects.create(name=request.data["tag"])
    except IntegrityError:
        pass
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def tag_if_new_atomic(request: Request) -> Response:
    """The same, written as Django advises: the statement whose error is
    caught has its own atomic()."""
    charge = _charge(request)
    try:
        with transaction.atomic():
            Tag.objects.create(name=request.data["tag"])
    except IntegrityError:
        pass
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def inner_block_without_savepoint(request: Request) -> Response:
    charge = _charge(request)
    try:
        with transaction.atomic(savepoint=False):
            Tag.objects.create(name=request.data["tag"])
    except IntegrityError:
        pass
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def rolls_back_on_purpose(request: Request) -> Response:
    charge = _charge(request)
    transaction.set_rollback(True)
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def durable_block(request: Request) -> Response:
    with transaction.atomic(durable=True):
        charge = _charge(request)
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def writes_to_other_database(request: Request) -> Response:
    charge = _charge(request)
    AuditEntry.objects.using("other").create(note=f"charge {charge.pk}")
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def swallows_its_other_database_error(request: Request) -> Response:
    charge = _charge(request)
    try:  # noqa: SIM105
        AuditEntry.objects.create(note=f"charge {charge.pk}")  # a router may send it elsewhere
    except Exception:
        pass
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def reads_other_database(request: Request) -> Response:
    charge = _charge(request)
    return Response({"charge": charge.pk, "audits": AuditEntry.objects.using("other").count()}, 201)


@api_view(["POST"])
@idempotent
def dangling_foreign_key(request: Request) -> Response:
    """A foreign key checked at COMMIT (deferred on PostgreSQL and SQLite)."""
    charge = _charge(request)
    LedgerEntry.objects.create(charge_id=charge.pk + 10**9, amount=1)
    return Response({"charge": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def with_commit_hooks(request: Request) -> Response:
    charge = _charge(request)
    transaction.on_commit(lambda: HOOK_CALLS.append(charge.pk))
    if request.data.get("hook_fails"):
        transaction.on_commit(_failing_hook)
    return Response({"charge": charge.pk}, status=201)


def _failing_hook() -> None:
    raise RuntimeError("the mail server is down")


@api_view(["POST"])
@idempotent
def locks_a_row(request: Request) -> Response:
    with transaction.atomic():
        charge = Charge.objects.select_for_update().get(pk=request.data["charge"])
        charge.amount += 1
        charge.save(update_fields=["amount"])
    return Response({"charge": charge.pk, "amount": charge.amount}, status=200)


@api_view(["POST"])
@idempotent
def attachment(request: Request) -> HttpResponse:
    charge = _charge(request)
    response = HttpResponse(b"\x1f\x8b fake gzip bytes", content_type="text/csv", status=201)
    response["Content-Encoding"] = "gzip"
    response["Content-Disposition"] = f'attachment; filename="charge-{charge.pk}.csv"'
    return response


class Upload(APIView):
    parser_classes = [FileUploadParser]

    @idempotent
    def post(self, request: Request, filename: str) -> Response:
        upload = request.data["file"]
        digest = hashlib.sha256()
        for chunk in upload.chunks():
            digest.update(chunk)
        _charge(request, label=digest.hexdigest()[:32])
        return Response({"size": upload.size, "sha256": digest.hexdigest()}, status=201)


class AlreadyDone(APIException):
    status_code = 409


def forgiving_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler (which marks the transaction for rollback under
    ATOMIC_REQUESTS), then 'already done' turned into a 200."""
    response = exception_handler(exc, context)
    if isinstance(exc, AlreadyDone):
        return Response({"already": True}, status=200)
    return response


class Forgiving(APIView):
    def get_exception_handler(self) -> Any:
        return forgiving_exception_handler

    @idempotent
    def post(self, request: Request) -> Response:
        _charge(request)
        raise AlreadyDone()


class NestedViewSet(IdempotentMixin, viewsets.ModelViewSet[Charge]):
    """The mixin covers PATCH (partial_update), and update carries its own
    decorator: partial_update calls update for the same request."""

    queryset = Charge.objects.all()
    serializer_class = ChargeSerializer

    @idempotent
    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().update(request, *args, **kwargs)


@api_view(["POST"])
@idempotent(fingerprint=lambda request: "every request alike")
def constant_fingerprint_a(request: Request) -> Response:
    if request.data.get("invalid"):
        return Response({"error": "invalid"}, status=400)
    return Response({"endpoint": "a", "charge": _charge(request).pk}, status=201)


@api_view(["POST"])
@idempotent(fingerprint=lambda request: "every request alike")
def constant_fingerprint_b(request: Request) -> Response:
    return Response({"endpoint": "b", "charge": _charge(request).pk}, status=201)


@api_view(["POST"])
@idempotent
def root(request: Request) -> Response:
    return Response({"charge": _charge(request).pk}, status=201)
