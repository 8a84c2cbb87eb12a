"""A Celery app for the worker races (tests/test_celery.py): the pattern of
docs/service.md, ``@app.task(autoretry_for=(KeyInProgress,))`` over
``@idempotent_task``, on the RabbitMQ broker.

Configured from the environment the test gives its worker:
IDEMPOTENCY_TEST_CELERY_BROKER (default amqp://guest:guest@127.0.0.1:5672//),
IDEMPOTENCY_TEST_CELERY_QUEUE (one per test run, so runs never share
messages) and the database variables of tests/server_settings.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import django
from celery import Celery
from kombu import Queue

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.server_settings")
django.setup()

from idempotency_app.service import KeyInProgress, idempotent_task  # noqa: E402
from tests.testapp.models import Charge, LedgerEntry  # noqa: E402

BROKER = os.environ.get("IDEMPOTENCY_TEST_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
QUEUE = os.environ.get("IDEMPOTENCY_TEST_CELERY_QUEUE", "idempotency-tests")
# A claim the killed worker left is taken over this long after it was made.
LEASE = 3

app = Celery("idempotency_tests", broker=BROKER, backend="rpc://")
app.conf.update(
    task_default_queue=QUEUE,
    # Idle queues vanish from the broker after two minutes.
    task_queues=[Queue(QUEUE, queue_arguments={"x-expires": 120_000})],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=300,
)


@app.task(autoretry_for=(KeyInProgress,), retry_kwargs={"countdown": 0.3, "max_retries": 200})
@idempotent_task(key=lambda event: event["id"], scope="celery:test", lease=LEASE)
def apply_event(event: dict[str, Any]) -> dict[str, Any]:
    """Two writes. Each attempt that gets to run appends a line to
    ``event["attempts"]``; the first one then hangs for ``event["hang"]``
    seconds (to be killed), later ones for ``event["sleep"]``."""
    attempts = Path(event["attempts"])
    first = not attempts.exists()
    with attempts.open("a") as log:
        log.write(f"{os.getpid()}\n")
    charge = Charge.objects.create(label=event["id"], amount=int(event.get("amount", 1)))
    time.sleep(float(event.get("hang", 0) if first else event.get("sleep", 0)))
    LedgerEntry.objects.create(charge=charge, amount=charge.amount)
    return {"charge": charge.pk, "event": event["id"]}
