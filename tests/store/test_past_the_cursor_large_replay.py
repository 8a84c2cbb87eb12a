"""A replay of a large body (HELD_RESULT_BYTES or more) is not left held by
anything the connection keeps, as ``found`` lets go of the kept cursor for
that reason: the claim's row reader (psycopg's Transformer, kept per
driver connection) lets go of the claim's result once its row is read.
Held, it would stay until the next replay on that connection (fresh claims
never read a row), under CONN_MAX_AGE for the connection's life."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection, connections

from idempotency_app import service
from idempotency_app.store import base as store_base

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]


def _held_bytes(conn: Any) -> int:
    """The largest PGresult held by what the connection keeps in its dict."""
    largest = 0
    for value in vars(conn).values():
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            res = getattr(item, "pgresult", None)
            if res is None:
                continue
            size = 0
            for row in range(res.ntuples):
                for col in range(res.nfields):
                    v = res.get_value(row, col)
                    size += 0 if v is None else len(v)
            largest = max(largest, size)
    return largest


def test_a_large_replay_is_not_held_after_the_claim() -> None:
    key = str(uuid.uuid4())
    payload = "x" * 200_000

    def run(key: str = key, payload: str = payload) -> Any:
        with service.once("tests:past-the-cursor-held", key, "tests.past-the-cursor") as r:
            if r.should_execute:
                r.result = payload
        return r.result

    try:
        assert run() == payload
        assert run() == payload  # the replay, read by the claim
        assert run(str(uuid.uuid4()), "small") == "small"  # a later, fresh request
        assert _held_bytes(connections["default"]) < store_base.HELD_RESULT_BYTES
    finally:
        connection.close()
