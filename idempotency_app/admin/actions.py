"""The admin action that expires completed records ahead of their TTL.

A client bug can store a wrong result under a key the client must use again
(it sent the wrong amount and keeps retrying the corrected request, which
gets 422). Expiring the record makes the next request with that key run the
operation again. That is exactly what idempotency exists to prevent, so
the action asks for confirmation, needs the delete permission, and logs
who did it.

The write is one conditional UPDATE on ``DATABASE_ALIAS``, judged by the
database's clock: only records still completed and inside their window are
touched, so a record that expired or was taken over meanwhile is left as it
is, and nothing is read first to decide.
"""

from __future__ import annotations

import logging
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from idempotency_app.clock import DatabaseNow
from idempotency_app.conf import conf
from idempotency_app.lifecycle import replays
from idempotency_app.models import IdempotencyRecord

logger = logging.getLogger("idempotency_app")

COMPLETED = IdempotencyRecord.Status.COMPLETED
TEMPLATE = "admin/idempotency_app/idempotencyrecord/expire_confirmation.html"
# Records listed on the confirmation page; the rest are counted.
SHOWN = 20


def replaying(records: QuerySet[IdempotencyRecord]) -> QuerySet[IdempotencyRecord]:
    """The records among ``records`` that a retry would replay now."""
    return records.filter(status=COMPLETED, expires_at__gt=DatabaseNow())


def expire(records: QuerySet[IdempotencyRecord], using: str) -> int:
    """Expire the completed, unexpired records among ``records`` in one
    UPDATE on ``using``; the number expired."""
    expired: int = replaying(records).using(using).update(expires_at=DatabaseNow())
    return expired


@admin.action(
    description="Expire selected completed records (their keys run again)", permissions=["expire"]
)
def expire_records(
    modeladmin: Any, request: HttpRequest, queryset: QuerySet[IdempotencyRecord]
) -> TemplateResponse | None:
    if request.POST.get("post") == "yes":
        expired = expire(queryset, conf.DATABASE_ALIAS)
        replays.clear_on_commit(conf.DATABASE_ALIAS)
        logger.warning(
            "%s (user pk %s) expired %d completed idempotency records ahead of their TTL "
            "from the admin (%s); the next request with each key runs again.",
            request.user.get_username(),
            request.user.pk,
            expired,
            _selection(request),
        )
        modeladmin.message_user(
            request,
            f"Expired {expired} completed records: the next request with each key runs again.",
            messages.SUCCESS,
        )
        return None
    candidates = replaying(queryset).order_by("-pk")
    shown = list(candidates[:SHOWN])
    count = len(shown) if len(shown) < SHOWN else candidates.count()
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": "Expire completed records?",
        "opts": modeladmin.model._meta,
        "media": modeladmin.media,
        "count": count,
        "shown": shown,
        "more": count - len(shown),
        "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        "select_across": request.POST.get("select_across") == "1",
        "action": request.POST.get("action", "expire_records"),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, TEMPLATE, context)


def _selection(request: HttpRequest) -> str:
    """What the operator selected, for the log line."""
    if request.POST.get("select_across") == "1":
        return f"all records matching {request.GET.urlencode() or 'no filter'}"
    return "records with pk " + ", ".join(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))
