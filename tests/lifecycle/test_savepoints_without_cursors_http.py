"""Savepoints without cursors: consecutive HTTP requests on one persistent connection, views
with blocks, caught errors in blocks, and replays."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connections

from tests.conftest import new_key, post
from tests.testapp.models import Tag

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def test_sequence_on_one_connection(api: Any) -> None:
    conn = connections["default"]
    keys = [new_key() for _ in range(6)]
    pid = None
    for i, key in enumerate(keys):
        tag = "dup" if i % 2 else f"t{i}"
        r = post(api, "/patterns/tag-if-new-atomic/", {"tag": tag, "label": f"c{i}"}, key)
        assert r.status_code == 201, r.content
        assert "_savepoint" not in vars(conn) and "_savepoint_commit" not in vars(conn)
        if conn.connection is not None:
            pid = pid or conn.connection.info.backend_pid
            assert conn.connection.info.transaction_status.name == "IDLE"
    for i, key in enumerate(keys):
        tag = "dup" if i % 2 else f"t{i}"
        r = post(api, "/patterns/tag-if-new-atomic/", {"tag": tag, "label": f"c{i}"}, key)
        assert r.status_code == 201
        assert r.headers.get("Idempotent-Replayed") == "true"
    assert sorted(Tag.objects.values_list("name", flat=True)) == ["dup", "t0", "t2", "t4"]
