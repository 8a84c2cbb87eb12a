"""The read-only admin through the test client, logged in as staff."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import formats, timezone

from idempotency_app import admin as record_admin, clock
from idempotency_app.models import IdempotencyRecord

pytestmark = pytest.mark.django_db

URL = "/admin/idempotency_app/idempotencyrecord/"
IN_PROGRESS = IdempotencyRecord.Status.IN_PROGRESS
COMPLETED = IdempotencyRecord.Status.COMPLETED
JSON = '[["Content-Type", "application/json"], ["Location", "/charges/7/"]]'


def make(key: str, **fields: Any) -> IdempotencyRecord:
    now = clock.now()
    values: dict[str, Any] = {
        "scope": "user:1",
        "key": key,
        "operation": "POST charges/",
        "fingerprint": "f" * 64,
        "status": COMPLETED,
        "token": "t" * 32,
        "created_at": now,
        "expires_at": now + timedelta(hours=1),
        "response_status": 201,
        "response_headers": JSON,
        "response_body": b'{"id":7,"items":[1,2]}',
    }
    values.update(fields)
    return IdempotencyRecord.objects.create(**values)


def staff(username: str, *perms: str) -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=perms))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def ops() -> Client:
    return staff("ops", "view_idempotencyrecord", "delete_idempotencyrecord")


@pytest.fixture
def viewer() -> Client:
    return staff("viewer", "view_idempotencyrecord")


@pytest.fixture
def records() -> dict[str, IdempotencyRecord]:
    now = clock.now()
    return {
        "done": make("key-done"),
        "other": make("key-other", scope="user:2", operation="PATCH charges/<int:pk>/"),
        "old": make(
            "key-old", expires_at=now - timedelta(seconds=1), created_at=now - timedelta(days=2)
        ),
        "claim": make(
            "key-claim",
            status=IN_PROGRESS,
            locked_until=now + timedelta(seconds=60),
            response_status=None,
            response_headers="",
            response_body=None,
        ),
    }


def listed(response: Any) -> set[str]:
    assert response.status_code == 200
    return {r.key for r in response.context["cl"].result_list}


def test_changelist_lists_records_with_columns(ops: Client, records: dict[str, Any]) -> None:
    response = ops.get(URL)
    assert listed(response) == {"key-done", "key-other", "key-old", "key-claim"}
    html = response.content.decode()
    for column in (
        "Key",
        "Scope",
        "Operation",
        "Status",
        "Response status",
        "Created at",
        "Expires at",
    ):
        assert f">{column}<" in html
    assert f"{URL}add/" not in html
    assert "delete_selected" not in html
    assert "release_claims" in html


def test_search_is_exact_on_key_and_scope(ops: Client, records: dict[str, Any]) -> None:
    assert listed(ops.get(URL, {"q": "key-done"})) == {"key-done"}
    assert listed(ops.get(URL, {"q": "key-do"})) == set()
    assert listed(ops.get(URL, {"q": "user:2"})) == {"key-other"}
    assert listed(ops.get(URL, {"q": "user:1 key-old"})) == {"key-old"}


def test_search_is_case_sensitive(ops: Client, records: dict[str, Any]) -> None:
    assert listed(ops.get(URL, {"q": "KEY-DONE"})) == set()


def test_status_filter(ops: Client, records: dict[str, Any]) -> None:
    assert listed(ops.get(URL, {"status__exact": "in_progress"})) == {"key-claim"}
    assert listed(ops.get(URL, {"status__exact": "completed"})) == {
        "key-done",
        "key-other",
        "key-old",
    }


def test_operation_filter_offers_recent_operations(ops: Client, records: dict[str, Any]) -> None:
    response = ops.get(URL, {"operation": "PATCH charges/<int:pk>/"})
    assert listed(response) == {"key-other"}
    html = response.content.decode()
    assert "?operation=POST+charges%2F" in html


def test_expired_filter(ops: Client, records: dict[str, Any]) -> None:
    assert listed(ops.get(URL, {"expired": "yes"})) == {"key-old"}
    assert listed(ops.get(URL, {"expired": "no"})) == {"key-done", "key-other", "key-claim"}


def test_expired_filter_follows_the_clock(ops: Client, records: dict[str, Any]) -> None:
    with clock.freeze(clock.now() + timedelta(hours=2)):
        assert len(listed(ops.get(URL, {"expired": "yes"}))) == 4


def test_date_hierarchy_offers_recent_days_without_a_query(
    ops: Client, records: dict[str, Any]
) -> None:
    today = timezone.localdate(clock.now())
    with CaptureQueriesContext(connection) as queries:
        html = ops.get(URL, {"status__exact": "completed"}).content.decode()
    sql = " ".join(q["sql"].upper() for q in queries.captured_queries)
    assert "MIN(" not in sql
    assert "DISTINCT" not in sql
    link = (
        f"?status__exact=completed&amp;created_at__year={today.year}"
        f"&amp;created_at__month={today.month}&amp;created_at__day={today.day}"
    )
    assert f'<a href="{link}">{formats.date_format(today, "MONTH_DAY_FORMAT")}</a>' in html
    assert "All dates" not in html


def test_date_hierarchy_filters_by_day(ops: Client, records: dict[str, Any]) -> None:
    today = timezone.localdate(clock.now())
    params = {
        "created_at__year": today.year,
        "created_at__month": today.month,
        "created_at__day": today.day,
    }
    response = ops.get(URL, params)
    assert listed(response) == {"key-done", "key-other", "key-claim"}
    html = response.content.decode()
    assert '<a href="?" class="date-back">&lsaquo; All dates</a>' in html
    assert f'">{formats.date_format(today, "MONTH_DAY_FORMAT")}</a>' not in html


def test_detail_shows_pretty_json_and_headers(viewer: Client, records: dict[str, Any]) -> None:
    response = viewer.get(f"{URL}{records['done'].pk}/change/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "{\n  &quot;id&quot;: 7,\n  &quot;items&quot;: [\n    1,\n    2\n  ]\n}" in html
    assert "Content-Type: application/json\nLocation: /charges/7/" in html
    assert "t" * 32 not in html  # the claim token is not shown
    assert 'name="_save"' not in html


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        (
            {"response_headers": '[["Content-Type", "image/png"]]', "response_body": b"\x89PNG\r"},
            "5 bytes of image/png",
        ),
        (
            {
                "response_headers": '[["Content-Type", "text/plain"]]',
                "response_body": b"all <good>",
            },
            "all &lt;good&gt;",
        ),
        (
            {
                "response_headers": '[["Content-Type", "text/plain; charset=latin-1"]]',
                "response_body": b"caf\xe9",
            },
            "café",
        ),
        (
            {
                "response_headers": '[["Content-Type", "application/json"]]',
                "response_body": b"{not json",
            },
            "{not json",
        ),
        ({"response_body": None}, "Not stored (larger than MAX_BODY_BYTES, or streamed)"),
        ({"response_body": b""}, "Empty."),
        (
            {"status": IN_PROGRESS, "response_body": None},
            "No response yet: the request is in progress.",
        ),
        (
            {"status": "interrupted", "response_status": 500, "response_body": None},
            "request_outcome_unknown",
        ),
    ],
)
def test_detail_body_forms(viewer: Client, fields: dict[str, Any], shown: str) -> None:
    record = make("k", **fields)
    response = viewer.get(f"{URL}{record.pk}/change/")
    assert shown in response.content.decode()


def test_release_action_deletes_only_in_progress_and_interrupted(
    ops: Client, records: dict[str, Any]
) -> None:
    """An interrupted key is released once its work's effects are checked;
    a completed one never: its next retry would run the work again."""
    interrupted = make("key-interrupted", status="interrupted", response_status=500)
    selected = [records["claim"].pk, records["done"].pk, interrupted.pk]
    response = ops.post(
        URL, {"action": "release_claims", "_selected_action": selected, "index": 0}, follow=True
    )
    html = response.content.decode()
    assert "Released 2 stuck claims or interrupted keys." in html
    assert "Kept 1 selected records that are neither in progress nor interrupted" in html
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {
        "key-done",
        "key-other",
        "key-old",
    }


def test_release_needs_delete_permission(viewer: Client, records: dict[str, Any]) -> None:
    assert "release_claims" not in viewer.get(URL).content.decode()
    viewer.post(
        URL, {"action": "release_claims", "_selected_action": [records["claim"].pk], "index": 0}
    )
    assert IdempotencyRecord.objects.filter(key="key-claim").exists()


def test_add_change_and_delete_are_refused(ops: Client, records: dict[str, Any]) -> None:
    pk = records["claim"].pk
    assert ops.get(f"{URL}add/").status_code == 403
    assert ops.post(f"{URL}add/", {"key": "new"}).status_code == 403
    assert ops.post(f"{URL}{pk}/change/", {"key": "changed"}).status_code == 403
    assert ops.post(f"{URL}{pk}/delete/", {"post": "yes"}).status_code == 403
    assert IdempotencyRecord.objects.get(pk=pk).key == "key-claim"


def test_unfiltered_count_is_exact_below_the_estimate_threshold(
    ops: Client, records: dict[str, Any]
) -> None:
    cl = ops.get(URL).context["cl"]
    assert cl.result_count == 4
    assert cl.full_result_count is None  # no second COUNT over the table


@pytest.mark.django_db(transaction=True)
def test_unfiltered_count_uses_table_statistics(
    ops: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(5):
        make(f"k{i}")
    vendor = connection.vendor
    with connection.cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute("ANALYZE idempotency_app_idempotencyrecord")
        elif vendor == "mysql":
            cursor.execute("ANALYZE TABLE idempotency_app_idempotencyrecord")
            cursor.fetchall()
    IdempotencyRecord.objects.filter(key__in=["k0", "k1"]).delete()
    monkeypatch.setattr(record_admin, "ESTIMATE_FROM", 1)
    estimate = record_admin.estimated_count(IdempotencyRecord.objects.all())
    assert record_admin.estimated_count(IdempotencyRecord.objects.filter(key="k2")) is None
    result_count = ops.get(URL).context["cl"].result_count
    if vendor == "sqlite":
        assert estimate is None
        assert result_count == 3
    elif vendor == "postgresql":
        assert estimate == 5  # ANALYZE saw 5 rows; the deletes are not counted
        assert result_count == 5
    else:
        assert estimate is not None
        assert result_count == estimate
    assert ops.get(URL, {"q": "k2"}).context["cl"].result_count == 1


def test_release_keeps_a_claim_that_completes_meanwhile(
    ops: Client, records: dict[str, Any]
) -> None:
    from tests.test_sweep import completed_just_before_the_delete

    with completed_just_before_the_delete("key-claim"):
        response = ops.post(
            URL,
            {"action": "release_claims", "_selected_action": [records["claim"].pk], "index": 0},
            follow=True,
        )
    assert "Released 0 stuck claims or interrupted keys." in response.content.decode()
    assert IdempotencyRecord.objects.get(key="key-claim").status == "completed"


@pytest.mark.parametrize(("param", "tie"), [("7", "ASC"), ("-7", "DESC")])
def test_sorting_by_expiry_breaks_ties_in_the_same_direction(
    ops: Client, records: dict[str, Any], param: str, tie: str
) -> None:
    """Mixed directions (expiry ascending, id descending) keep MySQL and
    MariaDB from reading the expiry index in order."""
    with CaptureQueriesContext(connection) as queries:
        assert ops.get(URL, {"o": param}).status_code == 200
    listing = [q["sql"] for q in queries.captured_queries if "ORDER BY" in q["sql"]][-1]
    order = listing.split("ORDER BY", 1)[1]
    direction = "DESC" if param.startswith("-") else "ASC"
    assert "expires_at" in order and f"{direction}" in order.split(",")[0]
    assert order.split(",")[1].strip().split()[-1].upper().startswith(tie)


def test_search_by_scope_reads_the_scope_index(ops: Client, records: dict[str, Any]) -> None:
    """On PostgreSQL the scope index is in the "C" collation, which only this
    search uses: a claim's scope = ... AND key = ... can never be planned on
    it instead of the unique index."""
    if connection.vendor != "postgresql":
        pytest.skip("the collated scope index is PostgreSQL's")
    with CaptureQueriesContext(connection) as queries:
        assert ops.get(URL, {"q": "user:2"}).status_code == 200
    listing = [q["sql"] for q in queries.captured_queries if 'COLLATE "C"' in q["sql"]]
    assert listing, "the search compares scopes in the index's collation"
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_get_indexdef('idempotency_scope_idx'::regclass)")
        assert 'COLLATE "C"' in cursor.fetchone()[0]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a few rows here, millions there
        cursor.execute("EXPLAIN " + listing[-1].split(" LIMIT ")[0])
        plan = " ".join(row[0] for row in cursor.fetchall())
    assert "idempotency_scope_idx" in plan, plan
