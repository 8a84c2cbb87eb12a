"""A Celery app for the worker races (tests/service/test_celery.py): the recipe of
docs/tasks.md ("Celery") as it stands there, on RabbitMQ or on Redis.

A worker builds ``app`` from its environment: IDEMPOTENCY_TEST_CELERY_BROKER
(default amqp://guest:guest@127.0.0.1:5672//), IDEMPOTENCY_TEST_CELERY_QUEUE
(one per test run, so runs never share messages) and the database variables
of tests/server_settings.py. The test process builds one app per broker with
``make_app``.
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
TASK_NAME = "tests.celery_app.apply_event"

# The recipe's LEASE, lowered so that a killed attempt's claim is taken over
# within seconds. Everything else below is the recipe, word for word.
LEASE = 3

RECIPE_TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "autoretry_for": (KeyInProgress,),
    "retry_kwargs": {"countdown": 1, "max_retries": 2 * LEASE},
}
RECIPE_SETTINGS: dict[str, Any] = {
    "worker_prefetch_multiplier": 1,
    "broker_transport_options": {"visibility_timeout": 2 * LEASE},
}


@idempotent_task(key=lambda event: event["id"], scope="celery:test", lease=LEASE)
def apply_event(event: dict[str, Any]) -> dict[str, Any]:
    """Two writes. Each attempt that gets to run appends its pid to
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


def is_redis(broker: str) -> bool:
    return broker.startswith(("redis://", "rediss://"))


def make_app(broker: str, queue: str) -> Celery:
    """The recipe on ``broker``, plus what keeps test runs apart and short."""
    redis = is_redis(broker)
    app = Celery("idempotency_tests", broker=broker, backend=broker if redis else "rpc://")
    app.conf.update(RECIPE_SETTINGS)
    app.conf.update(
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        result_expires=300,
    )
    if redis:
        app.conf.broker_transport_options = {
            **RECIPE_SETTINGS["broker_transport_options"],
            # Runs sharing the server keep their queues and their
            # unacknowledged messages apart.
            "global_keyprefix": f"{queue}:",
            # Look for messages past visibility_timeout every second (about
            # every 100 s by default, and in kombu versions without these
            # options), so a killed worker's message comes back in seconds.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    else:
        # Idle queues vanish from the broker after two minutes.
        app.conf.task_queues = [Queue(queue, queue_arguments={"x-expires": 120_000})]
    app.task(name=TASK_NAME, shared=False, **RECIPE_TASK_OPTIONS)(apply_event)
    return app


app = make_app(BROKER, QUEUE)
