from __future__ import annotations

from typing import Any

import pytest
from django.test import RequestFactory
from django.test.utils import override_settings
from django.urls import resolve

from idempotency_app import keys


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ("abc", "abc"),
        ("  abc  ", "abc"),
        ('"abc"', "abc"),
        ('"a\\"b"', 'a"b'),
        ('"a\\\\b"', "a\\b"),
        ("a b", "a b"),
        ("k" * 255, "k" * 255),
        ("~!@#$%^&*()", "~!@#$%^&*()"),
    ],
)
def test_parse_key_accepts(raw: str | None, expected: str | None) -> None:
    assert keys.parse_key(raw) == expected


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ('""', "empty"),
        ("k" * 256, "longer than 255"),
        ('"' + "k" * 256 + '"', "longer than 255"),
        ("a\x00b", "printable ASCII"),
        ("a\x7fb", "printable ASCII"),
        ("caf\u00e9", "printable ASCII"),
        ("\u2603", "printable ASCII"),
        ('"a\\nb"', "invalid escape"),
        ('"a"b"', "unescaped"),
    ],
)
def test_parse_key_refuses_with_a_reason(raw: str, reason: str) -> None:
    with pytest.raises(keys.InvalidKey, match=reason):
        keys.parse_key(raw)


def _request(path: str, body: bytes, content_type: str = "application/json", **extra: Any) -> Any:
    request = RequestFactory().post(path, body, content_type=content_type, **extra)
    request.resolver_match = resolve(path.split("?")[0])
    request.content_type = content_type  # what DRF's Request exposes
    return request


def test_operation_uses_the_route_not_the_path() -> None:
    assert (
        keys.operation(_request("/accounts/7/charges/", b"{}"))
        == "POST accounts/<int:account>/charges/"
    )


def test_fingerprint_ignores_json_key_order_and_whitespace() -> None:
    a = keys.fingerprint(_request("/charges/", b'{"a": 1, "b": [1, 2]}'))
    b = keys.fingerprint(_request("/charges/", b'{"b":[1,2],"a":1}'))
    assert a == b


def test_fingerprint_changes_with_body_url_arguments_and_route() -> None:
    base = keys.fingerprint(_request("/accounts/1/charges/", b'{"a": 1}'))
    assert base != keys.fingerprint(_request("/accounts/1/charges/", b'{"a": 2}'))
    assert base != keys.fingerprint(_request("/accounts/2/charges/", b'{"a": 1}'))
    assert base != keys.fingerprint(_request("/charges/", b'{"a": 1}'))


def test_non_json_bodies_are_hashed_raw() -> None:
    a = keys.fingerprint(_request("/charges/", b"a=1&b=2", "application/x-www-form-urlencoded"))
    b = keys.fingerprint(_request("/charges/", b"b=2&a=1", "application/x-www-form-urlencoded"))
    assert a != b


@pytest.mark.parametrize("body", [b"{not json", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe"])
def test_unparseable_json_falls_back_to_raw_bytes(body: bytes) -> None:
    assert len(keys.fingerprint(_request("/charges/", body))) == 64


def test_large_json_is_hashed_without_reserialising() -> None:
    body = b'{"pad": "' + b"x" * (keys.CANONICAL_JSON_MAX_BYTES + 1) + b'"}'
    assert keys.canonical_body(_request("/charges/", body), body) is body


def test_named_query_params_and_headers_join_the_fingerprint() -> None:
    def fp(query: str, currency: str) -> str:
        return keys.fingerprint(_request(f"/charges/{query}", b"{}", HTTP_X_CURRENCY=currency))

    assert fp("?mode=a", "EUR") == fp("?mode=b", "USD"), "ignored unless named"
    with override_settings(
        IDEMPOTENCY={"FINGERPRINT_QUERY_PARAMS": ["mode"], "FINGERPRINT_HEADERS": ["X-Currency"]}
    ):
        assert fp("?mode=a", "EUR") != fp("?mode=b", "EUR")
        assert fp("?mode=a", "EUR") != fp("?mode=a", "USD")


def test_long_scopes_are_hashed_not_truncated() -> None:
    long_a, long_b = "t" * 300 + "a", "t" * 300 + "b"
    assert keys.bounded_scope("user:1") == "user:1"
    assert len(keys.bounded_scope(long_a)) <= 255
    assert keys.bounded_scope(long_a) != keys.bounded_scope(long_b)
