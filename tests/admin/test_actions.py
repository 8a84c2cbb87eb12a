"""The admin's "expire" action: a confirmation, one conditional UPDATE, a
log line naming who, and a key that runs again afterwards."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.contrib.admin import helpers
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from idempotency_app.admin.actions import expire, replaying
from idempotency_app.models import IdempotencyRecord
from tests.admin import test_admin
from tests.admin.test_admin import COMPLETED, IN_PROGRESS, URL, staff
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db

ACTION = "expire_records"
# The admin tests' fixtures: a staff user who may delete, and one record of each kind.
ops = test_admin.ops
records = test_admin.records


def select(*records: IdempotencyRecord, **extra: str) -> dict[str, Any]:
    return {"action": ACTION, helpers.ACTION_CHECKBOX_NAME: [r.pk for r in records], **extra}


def still_replays(record: IdempotencyRecord) -> bool:
    return replaying(IdempotencyRecord.objects.filter(pk=record.pk)).exists()


def test_the_action_asks_first_and_lists_what_it_would_expire(
    ops: Client, records: dict[str, IdempotencyRecord]
) -> None:
    response = ops.post(URL, select(records["done"], records["old"], records["claim"]))
    assert response.status_code == 200
    html = response.content.decode()
    assert "Expire 1 completed record now" in html
    assert "key-done" in html and "key-old" not in html and "key-claim" not in html
    assert 'name="post" value="yes"' in html
    assert all(still_replays(r) for r in (records["done"], records["other"]))


def test_confirming_expires_with_one_conditional_update(
    ops: Client, records: dict[str, IdempotencyRecord]
) -> None:
    chosen = select(records["done"], records["old"], records["claim"], post="yes")
    with CaptureQueriesContext(connection) as queries:
        response = ops.post(URL, chosen, follow=True)
    writes = [q["sql"] for q in queries if "idempotency_app_idempotencyrecord" in q["sql"]]
    updates = [sql for sql in writes if sql.lstrip().upper().startswith("UPDATE")]
    assert len(updates) == 1
    assert "status" in updates[0] and "expires_at" in updates[0].split("WHERE", 1)[1]
    assert not any(sql.lstrip().upper().startswith("DELETE") for sql in writes)
    assert "Expired 1 completed records" in response.content.decode()
    assert not still_replays(records["done"])
    assert still_replays(records["other"])  # not selected
    claim = IdempotencyRecord.objects.get(pk=records["claim"].pk)
    assert claim.status == IN_PROGRESS and claim.expires_at == records["claim"].expires_at


def test_the_log_line_names_who_expired_what(
    ops: Client, records: dict[str, IdempotencyRecord], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="idempotency_app"):
        ops.post(URL, select(records["done"], post="yes"))
    line = next(r.getMessage() for r in caplog.records if "ahead of their TTL" in r.getMessage())
    ops_user = User.objects.get(username="ops")
    assert line.startswith(f"ops (user pk {ops_user.pk}) expired 1 ")
    assert f"pk {records['done'].pk}" in line


def test_select_across_expires_what_the_filter_matches(
    ops: Client, records: dict[str, IdempotencyRecord]
) -> None:
    page = f"{URL}?q=user:2"
    confirm = ops.post(page, select(records["other"], select_across="1"))
    assert 'name="select_across" value="1"' in confirm.content.decode()
    ops.post(page, select(records["other"], select_across="1", post="yes"))
    assert not still_replays(records["other"])
    assert still_replays(records["done"])


def test_nothing_to_expire_says_so(ops: Client, records: dict[str, IdempotencyRecord]) -> None:
    response = ops.post(URL, select(records["old"], records["claim"]))
    assert "nothing to expire" in response.content.decode()


def test_it_needs_the_delete_permission(records: dict[str, IdempotencyRecord]) -> None:
    viewer = staff("viewer", "view_idempotencyrecord")
    assert ACTION not in viewer.get(URL).content.decode()
    viewer.post(URL, select(records["done"], post="yes"))
    assert still_replays(records["done"])


def test_a_recorded_key_runs_again_once_expired(
    api: APIClient, ops: Client, key: str, transactional_db: Any
) -> None:
    def charge() -> Any:
        return api.post("/charges/", {"amount": 5}, format="json", HTTP_IDEMPOTENCY_KEY=key)

    assert charge().status_code == 201
    assert charge()["Idempotent-Replayed"] == "true"
    record = IdempotencyRecord.objects.get(key=key)
    assert record.status == COMPLETED
    ops.post(URL, select(record, post="yes"))
    again = charge()
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 2


def test_expire_leaves_records_expired_meanwhile(records: dict[str, IdempotencyRecord]) -> None:
    everything = IdempotencyRecord.objects.all()
    assert expire(everything, "default") == 2
    assert expire(everything, "default") == 0
