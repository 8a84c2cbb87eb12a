"""A django.tasks task: the receipt for a credited provider payment.

The webhook enqueues it with ``enqueue_once`` inside the transaction that
credits the payment, keyed by the provider's event, so a webhook delivered
any number of times enqueues it once; ``@idempotent_task`` makes any copy
that is enqueued anyway (or re-run) send the receipt once. With the
database backend (django-tasks-db), run it with ``python manage.py
db_worker``.
"""

from __future__ import annotations

from typing import Any

from example_project.payments.models import ProviderPayment, Receipt
from idempotency_app import idempotent_task

try:
    from django.tasks import task
except ImportError:  # Django < 6.0: the django-tasks backport
    from django_tasks import task  # type: ignore[no-redef]


@task()
@idempotent_task(key=lambda payment_id: payment_id, scope="tasks:receipts", wait=20)
def send_receipt(payment_id: int) -> dict[str, Any]:
    payment = ProviderPayment.objects.get(pk=payment_id)
    receipt = Receipt.objects.create(payment=payment)
    # A real receipt would be e-mailed here, after the commit:
    # transaction.on_commit(lambda: send_mail(...)).
    return {"receipt": receipt.pk, "payment": payment.pk}
