"""django.tasks tasks under @idempotent_task, for the enqueue_once tests and
the worker races. Imported only where a task framework is installed."""

from __future__ import annotations

import time
from typing import Any

from idempotency_app.service import idempotent_task
from tests.testapp.models import Charge, LedgerEntry

try:
    from django.tasks import task
except ImportError:  # Django < 6.0: the backport
    from django_tasks import task  # type: ignore[no-redef]


@task()
@idempotent_task(key=lambda event: event["id"], scope="tasks:test", wait=30)
def apply_event(event: dict[str, Any]) -> dict[str, Any]:
    """Two writes with a pause between them, so an overlap would show."""
    charge = Charge.objects.create(label=event["id"], amount=int(event.get("amount", 1)))
    time.sleep(float(event.get("sleep", 0)))
    LedgerEntry.objects.create(charge=charge, amount=charge.amount)
    return {"charge": charge.pk, "event": event["id"]}


@task()
def plain(label: str) -> str:
    """Not idempotent: enqueue_once alone keeps it to one enqueue."""
    Charge.objects.create(label=label)
    return label
