"""Racing retries of a charge view that refunds through a nested
``service.once``, with Sentry-style (CursorWrapper.execute patched) and
OpenTelemetry-style (a traced cursor_factory set per connection)
instrumentation installed before the requests; autocommit and
ATOMIC_REQUESTS; PostgreSQL and MariaDB."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
from django.db import connections, transaction
from django.db.backends import utils
from django.db.backends.signals import connection_created
from django.test import override_settings
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.response import Response
from rest_framework.test import APIClient

from idempotency_app import service
from idempotency_app.decorators import idempotent
from tests.conftest import new_key, post
from tests.testapp.models import Charge, LedgerEntry

pytestmark = [pytest.mark.server_db, pytest.mark.django_db(transaction=True)]

SEEN: list[str] = []
HOOKS: list[int] = []


@api_view(["POST"])
@idempotent
def pay(request: Any) -> Response:
    with transaction.atomic():
        charge = Charge.objects.create(label="charge", amount=100)
        Charge.objects.select_for_update().get(pk=charge.pk)
        LedgerEntry.objects.create(charge=charge, amount=100)
    refund_key = service.derive_key("charges", request.META["HTTP_IDEMPOTENCY_KEY"], "refund")
    with service.once("tests:racing-instrumented-refund", refund_key, "refund") as run:
        if run.should_execute:
            refund = Charge.objects.create(label="refund", amount=-100)
            run.result = refund.pk
    transaction.on_commit(lambda: HOOKS.append(charge.pk))
    return Response({"id": charge.id, "refund": run.result}, status=201)


urlpatterns = [path("pay/", pay)]


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def atomic(request: Any) -> Any:
    conn = connections["default"]
    old = conn.settings_dict.get("ATOMIC_REQUESTS", False)
    conn.settings_dict["ATOMIC_REQUESTS"] = request.param
    yield request.param
    conn.settings_dict["ATOMIC_REQUESTS"] = old


@pytest.fixture
def instrumented() -> Any:
    original = utils.CursorWrapper.execute

    @functools.wraps(original)
    def traced(self: Any, sql: Any, params: Any = None) -> Any:
        SEEN.append("django")
        return original(self, sql, params)

    def per_connection(sender: Any, connection: Any, **kwargs: Any) -> None:
        raw = connection.connection
        base = getattr(raw, "cursor_factory", None)
        if base is None or not hasattr(base, "copy"):
            return

        class Traced(base):  # type: ignore[misc, valid-type]
            def execute(self, *args: Any, **kwargs: Any) -> Any:
                SEEN.append("driver")
                return super().execute(*args, **kwargs)

        raw.cursor_factory = Traced

    utils.CursorWrapper.execute = traced
    connection_created.connect(per_connection, weak=False)
    connections.close_all()
    SEEN.clear()
    HOOKS.clear()
    try:
        with override_settings(ROOT_URLCONF=__name__):
            yield
    finally:
        connection_created.disconnect(per_connection)
        utils.CursorWrapper.execute = original
        connections.close_all()


def test_racing_retries_run_once(user: Any, atomic: bool, instrumented: Any) -> None:
    key = new_key()
    results: list[tuple[int, bytes]] = []
    barrier = threading.Barrier(6)

    def go() -> None:
        client = APIClient(raise_request_exception=False)
        client.force_authenticate(user)
        try:
            barrier.wait()
            for _ in range(2):
                r = post(client, "/pay/", {"amount": 100}, key)
                results.append((r.status_code, r.content))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert Charge.objects.filter(label="charge").count() == 1, results[:2]
    assert Charge.objects.filter(label="refund").count() == 1
    assert LedgerEntry.objects.count() == 1
    assert {s for s, _ in results} <= {201, 409}, results
    assert len({c for s, c in results if s == 201}) == 1
    assert len(HOOKS) == 1
    assert "django" in SEEN
