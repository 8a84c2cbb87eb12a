"""Read-only admin for idempotency records, built to stay fast on a table of
millions of rows: no full counts, exact-match search, sortable only by an
indexed column, and an operation filter that never scans the whole table.

Nothing can be added, edited or deleted here. Deleting a completed record
inside its window would make the next retry execute the operation again
(a second charge, say), and expired records are the sweep command's job.
The writes are two actions: "release", which deletes in-progress claims and
interrupted keys only, so that a client's retry can run again, and "expire"
(``admin_actions``), which ends a completed record's window after a
confirmation, for a key that must run again.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ERROR_FLAG, ORDER_VAR, PAGE_VAR, ChangeList
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Q, QuerySet
from django.db.models.functions import Collate
from django.http import HttpRequest, HttpResponse
from django.template import engines
from django.template.response import TemplateResponse
from django.utils import formats, timezone
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import smart_split, unescape_string_literal

from idempotency_app import clock, store
from idempotency_app.admin.actions import expire_records
from idempotency_app.conf import conf
from idempotency_app.lifecycle import replays
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import parse_headers

# Below this many rows an exact COUNT is cheap, and an estimate from table
# statistics (stale or missing on a young table) would only mislead.
ESTIMATE_FROM = 100_000
# How many of the newest records the operation filter offers values from.
OPERATION_SAMPLE = 10_000
# Longest body text shown on the detail page.
MAX_SHOWN_CHARS = 100_000
IN_PROGRESS = IdempotencyRecord.Status.IN_PROGRESS
# Records released per DELETE: well under every backend's limit on parameters.
RELEASE_BATCH = 1000
INTERRUPTED = IdempotencyRecord.Status.INTERRUPTED
DATE_FIELD = "created_at"

# Django's own date hierarchy reads the whole table twice on every page (MIN
# and MAX, then SELECT DISTINCT of the truncated dates), and on MySQL it needs
# the server's time zone tables. Records live for TTL, so the days worth
# offering follow from the clock: this block lists them without a query, and
# Django still turns the chosen day into a created_at range filter.
CHANGE_LIST = (
    '{% extends "admin/change_list.html" %}{% block date_hierarchy %}'
    '{% include "admin/date_hierarchy.html" with show=True back=recent_days.back '
    "choices=recent_days.choices %}{% endblock %}"
)

if TYPE_CHECKING:
    RecordAdminBase = admin.ModelAdmin[IdempotencyRecord]
    PaginatorBase = Paginator[Any]
else:  # generic only in the type stubs
    RecordAdminBase = admin.ModelAdmin
    PaginatorBase = Paginator


def estimated_count(queryset: QuerySet[Any]) -> int | None:
    """The table's row count from the database's statistics, for an
    unfiltered queryset on PostgreSQL or MySQL; None when it must be counted."""
    if queryset.query.where:
        return None
    connection = connections[queryset.db]
    table = queryset.model._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)",
                [connection.ops.quote_name(table)],
            )
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT table_rows FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = %s",
                [table],
            )
        else:
            return None
        row = cursor.fetchone()
    if row is None or row[0] is None or int(row[0]) < ESTIMATE_FROM:
        return None
    return int(row[0])


class EstimatedCountPaginator(PaginatorBase):
    """A full COUNT(*) reads the whole table; the unfiltered list uses the
    planner's estimate instead. Filtered lists (a search, a filter) are
    counted exactly."""

    @cached_property
    def count(self) -> int:
        if isinstance(self.object_list, QuerySet):
            estimate = estimated_count(self.object_list)
            if estimate is not None:
                return estimate
        return super().count


class RecordChangeList(ChangeList):
    """Django breaks ties with ``-pk`` whatever the sort's direction; sorted
    by expiry ascending, that mixed direction keeps MySQL and MariaDB from
    reading the expiry index in order (they sort the whole table). The tie is
    broken in the sort's own direction instead.

    A period picked in the date drill-down is listed newest first by creation
    time, the order of ``idempotency_created_id_idx``, so a page reads only
    its own rows. By ``-pk``, as elsewhere, the database either sorts every
    row of the period or walks the primary key backward past every newer
    record (589,285 of them for a page of yesterday at a million rows). A
    sort the operator picks still wins."""

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        if f"{DATE_FIELD}__year" in self.params and ORDER_VAR not in self.params:
            return [f"-{DATE_FIELD}", "-pk"]
        ordering = list(super().get_ordering(request, queryset))
        first = ordering[0] if ordering else "-pk"
        if isinstance(first, str) and not first.startswith("-"):
            ordering = [first, *("pk" if part == "-pk" else part for part in ordering[1:])]
        return list(dict.fromkeys(ordering))


class ExpiredFilter(admin.SimpleListFilter):
    title = "expired"
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes"), ("no", "No")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(expires_at__lte=clock.DatabaseNow())
        if self.value() == "no":
            return queryset.filter(expires_at__gt=clock.DatabaseNow())
        return queryset


class OperationFilter(admin.SimpleListFilter):
    """Offers the operations seen among the newest records. A plain field
    filter would run SELECT DISTINCT over the whole table on every page."""

    title = "operation"
    parameter_name = "operation"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        newest = model_admin.get_queryset(request).order_by("-pk")
        names = set(newest.values_list("operation", flat=True)[:OPERATION_SAMPLE])
        if self.value():
            names.add(self.value())
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(operation=self.value()) if self.value() else queryset


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(RecordAdminBase):
    list_display = (
        "key",
        "scope",
        "operation",
        "status",
        "response_status",
        "created_at",
        "expires_at",
    )
    list_filter = ("status", OperationFilter, ExpiredFilter)
    # Exact matches only (see get_search_results): Django's default icontains
    # scans every row. Keys and scopes are case-sensitive, so iexact would be
    # both wrong and unindexable.
    search_fields = ("key__exact", "scope__exact")
    search_help_text = "An exact key or scope (user:42); both, space-separated, find one record."
    date_hierarchy = DATE_FIELD
    ordering = ("-pk",)
    sortable_by = ("expires_at",)
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    actions = ("release_claims", expire_records)
    fields = (
        "scope",
        "key",
        "operation",
        "fingerprint",
        "status",
        "created_at",
        "expires_at",
        "locked_until",
        "response_status",
        "stored_headers",
        "stored_body",
        "format_version",
    )
    readonly_fields = fields

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {"recent_days": recent_days(request), **(extra_context or {})}
        response = super().changelist_view(request, context)
        # The change list itself, not yet rendered (an action's own page, such
        # as expire's confirmation, keeps its template).
        if isinstance(response, TemplateResponse) and "cl" in (response.context_data or {}):
            response.template_name = engines["django"].from_string(CHANGE_LIST)
        return response

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """Each term is an exact key or an exact scope, and every term must
        match. A key is found through the (key, scope) unique index. On
        PostgreSQL a scope is compared in the "C" collation, the only one
        ``idempotency_scope_idx`` is built in, so the planner can never pick
        that index for a claim's ``scope = ... AND key = ...`` (it did, with
        stale statistics, reading a whole scope for every claim)."""
        if connections[queryset.db].vendor == "postgresql":
            queryset = queryset.alias(scope_in_index=Collate("scope", "C"))
            scope_lookup = "scope_in_index"
        else:
            scope_lookup = "scope"
        for term in smart_split(search_term):
            if term[:1] in ("'", '"') and term[-1:] == term[:1]:
                term = unescape_string_literal(term)
            queryset = queryset.filter(Q(key=term) | Q(**{scope_lookup: term}))
        return queryset, False

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RecordChangeList

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_release_permission(self, request: HttpRequest) -> bool:
        """Releasing is a delete, so it needs the model's delete permission."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.delete_{opts.model_name}")

    def has_expire_permission(self, request: HttpRequest) -> bool:
        """Expiring lets a key run again, as deleting its record would."""
        return self.has_release_permission(request)

    @admin.action(
        description="Release selected stuck claims and interrupted keys", permissions=["release"]
    )
    def release_claims(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Conditional DELETEs of up to RELEASE_BATCH records each: a claim
        that completes meanwhile is kept.
        An interrupted key is released once someone has checked what its
        work left behind: its next request runs the work again."""
        records = store.backend(conf.DATABASE_ALIAS)
        selected = released = 0
        pks = queryset.order_by().values_list("pk", flat=True).iterator(chunk_size=RELEASE_BATCH)
        while chunk := list(itertools.islice(pks, RELEASE_BATCH)):
            selected += len(chunk)
            released += records.release_selected(chunk)
        replays.clear_on_commit(conf.DATABASE_ALIAS)
        self.message_user(
            request, f"Released {released} stuck claims or interrupted keys.", messages.SUCCESS
        )
        if selected > released:
            self.message_user(
                request,
                f"Kept {selected - released} selected records that are neither in progress nor "
                "interrupted: completed records are never released.",
                messages.WARNING,
            )

    @admin.display(description="stored headers")
    def stored_headers(self, record: IdempotencyRecord) -> SafeString | str:
        pairs = _headers(record)
        if not pairs:
            return "None"
        return format_html("<pre>{}</pre>", format_html_join("\n", "{}: {}", pairs))

    @admin.display(description="stored body")
    def stored_body(self, record: IdempotencyRecord) -> SafeString | str:
        return describe_body(record)


def recent_days(request: HttpRequest) -> dict[str, Any]:
    """Links to each day a record can still be from (today back over TTL),
    keeping the page's other filters; the chosen day is shown unlinked."""
    params = request.GET.copy()
    for name in list(params):
        if name.startswith(f"{DATE_FIELD}__") or name in (PAGE_VAR, ERROR_FLAG):
            del params[name]
    chosen = [request.GET.get(f"{DATE_FIELD}__{part}") for part in ("year", "month", "day")]
    today = timezone.localdate(clock.now())
    choices = []
    for offset in range(min(31, math.ceil(conf.TTL / 86400) + 1)):
        day = today - timedelta(days=offset)
        title = formats.date_format(day, "MONTH_DAY_FORMAT")
        if chosen == [str(day.year), str(day.month), str(day.day)]:
            choices.append({"title": title, "link": None})
            continue
        link = params.copy()
        for part, value in (("year", day.year), ("month", day.month), ("day", day.day)):
            link[f"{DATE_FIELD}__{part}"] = str(value)
        choices.append({"title": title, "link": f"?{link.urlencode()}"})
    back = {"title": "All dates", "link": f"?{params.urlencode()}"} if chosen[0] else None
    return {"back": back, "choices": choices}


def _headers(record: IdempotencyRecord) -> list[tuple[str, str]]:
    try:
        return list(parse_headers(record.response_headers))
    except (ValueError, TypeError):
        return [("(unreadable)", record.response_headers)]


def describe_body(record: IdempotencyRecord) -> SafeString | str:
    """JSON indented, text as it is, anything else summarised."""
    if record.status == IN_PROGRESS:
        return "No response yet: the request is in progress."
    if record.status == IdempotencyRecord.Status.RELEASED:
        return (
            "No response stored: a validation error was answered and cached for "
            "TRANSIENT_ERROR_TTL; the next request with the key runs again."
        )
    if record.status == INTERRUPTED:
        return (
            "No response stored: the work ended its own transaction part-way, so part of it "
            "may have committed. Every request with the key answers 500 "
            "request_outcome_unknown. Check what the work left, then release the key to let "
            "it run again."
        )
    if record.response_body is None:
        return (
            "Not stored (larger than MAX_BODY_BYTES, or streamed): "
            "a replay sends the status and headers only."
        )
    body = bytes(record.response_body)
    if not body:
        return "Empty."
    content_type = next((v for n, v in _headers(record) if n.lower() == "content-type"), "")
    media_type, _, params = content_type.partition(";")
    media_type = media_type.strip().lower()
    if record.response_status is None:
        media_type = "application/json"  # a task's result
    charset = "utf-8"
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip():
            charset = value.strip().strip('"')
    if not _is_textual(media_type):
        return f"{len(body)} bytes of {media_type or 'unknown type'}"
    try:
        text = body.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return f"{len(body)} bytes of {media_type or 'unknown type'} (not valid {charset})"
    if media_type == "application/json" or media_type.endswith("+json"):
        with contextlib.suppress(ValueError, RecursionError):
            text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    if len(text) > MAX_SHOWN_CHARS:
        return format_html(
            "<pre>{}</pre><p>(first {} of {} characters)</p>",
            text[:MAX_SHOWN_CHARS],
            MAX_SHOWN_CHARS,
            len(text),
        )
    return format_html("<pre>{}</pre>", text)


def _is_textual(media_type: str) -> bool:
    return (
        not media_type
        or media_type.startswith("text/")
        or media_type.endswith(("+json", "+xml", "/json", "/xml", "/javascript"))
        or media_type == "application/x-www-form-urlencoded"
    )
