"""A day picked in the date drill-down is paged in the order of an index.

On a million rows, ordered by ``-pk`` as the rest of the change list is, a
page of yesterday walked the primary key past every record of today (584,490
rows) or read and sorted every row of the day. Ordered by creation time, the
index on (created_at, id) hands the page over in order: the page reads its
own rows. The plans are checked with the database's preference for sorting
and for scanning the whole table turned off, so that a handful of test rows
plans as a million would: if no index gave the order, a sort would still
appear, and if the primary key were walked, the created_at condition would be
a filter on it rather than the index's range.
"""

from __future__ import annotations

import json
from datetime import datetime, time, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from idempotency_app import clock
from tests.admin.test_admin import URL, listed, make, staff

pytestmark = pytest.mark.django_db

INDEX = "idempotency_created_id_idx"
TABLE = "idempotency_app_idempotencyrecord"
PER_DAY = 101  # the admin's list_per_page is 100


@pytest.fixture
def ops() -> Client:
    return staff("ops", "view_idempotencyrecord", "delete_idempotencyrecord")


def day_params(days_ago: int = 0) -> dict[str, Any]:
    day = timezone.localdate(clock.now()) - timedelta(days=days_ago)
    return {
        "created_at__year": day.year,
        "created_at__month": day.month,
        "created_at__day": day.day,
    }


def page_query(client: Client, params: dict[str, Any]) -> tuple[Any, str]:
    """The change list and the SQL of its page: the filtered statement with a LIMIT."""
    with CaptureQueriesContext(connection) as queries:
        response = client.get(URL, params)
    sql = [q["sql"] for q in queries.captured_queries if TABLE in q["sql"]]
    pages = [s for s in sql if " WHERE " in s and " LIMIT " in s]
    assert pages, sql
    return response, pages[-1]


def plan(sql: str) -> str:
    """The page's plan, as text, on a table too small for the planner to
    prefer an index unless told."""
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("SET LOCAL enable_sort = off")
            cursor.execute("EXPLAIN (FORMAT JSON) " + sql)
            return json.dumps(cursor.fetchone()[0])
        if connection.vendor == "mysql":
            cursor.execute("EXPLAIN " + sql)
            names = [c[0] for c in cursor.description]
            return json.dumps([dict(zip(names, row, strict=True)) for row in cursor.fetchall()])
        cursor.execute("EXPLAIN QUERY PLAN " + sql)
        return " | ".join(str(row[-1]) for row in cursor.fetchall())


@pytest.fixture
def days() -> None:
    """More records on each of the last three days than a page shows (so
    the page is a LIMIT, as on a large table), a minute apart from noon."""
    today = timezone.localdate(clock.now())
    for ago in range(3):
        noon = timezone.make_aware(datetime.combine(today - timedelta(days=ago), time(12)))
        for step in range(PER_DAY):
            make(f"key-{ago}-{step}", created_at=noon - timedelta(minutes=step))


def test_a_day_is_listed_newest_first_by_creation_time(ops: Client, days: None) -> None:
    yesterday = timezone.localdate(clock.now()) - timedelta(days=1)
    response, sql = page_query(ops, day_params(1))
    cl = response.context["cl"]
    assert list(cl.queryset.query.order_by) == ["-created_at", "-pk"]
    order = sql.split(" ORDER BY ", 1)[1].split(" LIMIT ")[0]
    assert order.replace('"', "").replace("`", "") == f"{TABLE}.created_at DESC, {TABLE}.id DESC"
    created = [r.created_at for r in cl.result_list]
    assert created and created == sorted(created, reverse=True)
    assert {timezone.localdate(at) for at in created} == {yesterday}
    assert len(listed(response)) == len(created)


def test_other_lists_keep_their_order(ops: Client, days: None) -> None:
    """The rest of the change list stays newest first by id (the scope
    search reads its (scope, id) index in that order), and a sort the
    operator picks wins over the drill-down's."""
    response, _ = page_query(ops, {"q": "user:1"})
    assert list(response.context["cl"].queryset.query.order_by) == ["-pk"]
    response, _ = page_query(ops, {**day_params(), "o": "-7"})  # expiry, after the checkbox
    assert list(response.context["cl"].queryset.query.order_by) == ["-expires_at", "-pk"]


def test_a_days_page_reads_the_index_in_order(ops: Client, days: None) -> None:
    _, sql = page_query(ops, day_params(1))
    shown = plan(sql)
    if connection.vendor == "postgresql":
        nodes = json.loads(shown)[0]["Plan"]
        scans = []
        stack = [nodes]
        while stack:
            node = stack.pop()
            stack += node.get("Plans", [])
            assert "Sort" not in node["Node Type"], shown
            if node.get("Index Name") == INDEX:
                scans.append(node)
        assert scans, shown
        assert scans[0]["Scan Direction"] == "Backward", shown
        assert "created_at" in scans[0].get("Index Cond", ""), shown
    elif connection.vendor == "mysql":
        (row,) = json.loads(shown)
        assert row["key"] == INDEX, shown
        assert "filesort" not in (row["Extra"] or ""), shown
    else:
        assert f"USING INDEX {INDEX} (created_at>" in shown.replace("COVERING ", ""), shown
        assert "TEMP B-TREE" not in shown, shown
