from __future__ import annotations

from datetime import timedelta

from django.test.utils import override_settings

from idempotency_app.conf import conf


def test_defaults() -> None:
    assert conf.TTL == 24 * 3600
    assert conf.LEASE == 60
    assert {"POST", "PATCH"} == conf.METHODS
    assert "content-type" in conf.STORED_HEADERS


def test_read_on_every_access() -> None:
    with override_settings(IDEMPOTENCY={"TTL": timedelta(hours=1), "METHODS": ["post", "put"]}):
        assert conf.TTL == 3600
        assert {"POST", "PUT"} == conf.METHODS
    assert conf.TTL == 24 * 3600


def test_never_stored_headers_cannot_be_added() -> None:
    with override_settings(
        IDEMPOTENCY={"STORE_HEADERS": ["Set-Cookie", "Authorization", "X-Request-Id"]}
    ):
        assert "x-request-id" in conf.STORED_HEADERS
        assert "set-cookie" not in conf.STORED_HEADERS
        assert "authorization" not in conf.STORED_HEADERS
