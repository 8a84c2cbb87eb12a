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


def _request(
    path: str, body: bytes | str, content_type: str = "application/json", **extra: Any
) -> Any:
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


def test_integers_beyond_64_bits_stay_distinct_and_order_free() -> None:
    """orjson would read both as the float 2e+19: one request."""
    big = keys.fingerprint(_request("/charges/", b'{"amount": 20000000000000000000, "a": 1}'))
    bigger = keys.fingerprint(_request("/charges/", b'{"amount": 20000000000000000001, "a": 1}'))
    reordered = keys.fingerprint(_request("/charges/", b'{"a": 1, "amount": 20000000000000000000}'))
    assert big != bigger
    assert big == reordered


def test_json_only_the_standard_library_reads_still_ignores_key_order() -> None:
    first = b'{"a": "\\ud800", "b": 1}'
    second = b'{"b": 1, "a": "\\ud800"}'
    assert keys.fingerprint(_request("/charges/", first)) == keys.fingerprint(
        _request("/charges/", second)
    )


def test_the_same_data_is_one_request_whichever_parser_read_it() -> None:
    """A 19-digit run sends a body to the standard library: it must still
    write the data as orjson does."""
    long_form = b'{"fee": 0.5000000000000000000, "label": "Jos\\u00e9"}'
    short_form = '{"label": "José", "fee": 0.5}'.encode()
    assert keys.fingerprint(_request("/charges/", long_form)) == keys.fingerprint(
        _request("/charges/", short_form)
    )


@pytest.mark.parametrize(
    "refused, accepted",
    [
        (b'\xef\xbb\xbf{"amount": 2500}', b'{"amount": 2500}'),  # a UTF-8 BOM
        ('{"amount": 2500}'.encode("utf-16"), b'{"amount": 2500}'),
        (b'{"amount": NaN}', b'{"amount": null}'),
        (b'{"amount": 1e400}', b'{"amount": null}'),
    ],
)
def test_a_body_the_view_refuses_is_not_the_corrected_one(refused: bytes, accepted: bytes) -> None:
    """DRF refuses these (400), or reads 1e400 as an infinity that no JSON
    can write back: fingerprinted as their bytes, never as the corrected body."""
    assert keys.canonical_body(_request("/charges/", refused), refused) == refused
    assert keys.fingerprint(_request("/charges/", refused)) != keys.fingerprint(
        _request("/charges/", accepted)
    )


def test_the_declared_charset_decides_what_the_view_sees() -> None:
    """DRF decodes with the declared charset. As Latin-1, the bytes
    b"Jos\\xc3\\xa9" are "JosÃ©": another payee than "Jos\\u00e9" ("José"),
    which they would be as UTF-8, and the same as the escaped "JosÃ©"."""
    latin1 = "application/json; charset=iso-8859-1"
    raw = _request("/charges/", '{"label": "JosÃ©"}', latin1)  # sent as Latin-1
    assert raw.body == b'{"label": "Jos\xc3\xa9"}'
    other_payee = _request("/charges/", '{"label": "Jos\\u00e9"}', latin1)
    same_payee = _request("/charges/", '{"label": "Jos\\u00c3\\u00a9"}', latin1)
    assert keys.fingerprint(raw) != keys.fingerprint(other_payee)
    assert keys.fingerprint(raw) == keys.fingerprint(same_payee)


def _form(data: dict[str, Any]) -> Any:
    request = RequestFactory().post("/charges/", data)  # multipart
    request.resolver_match = resolve("/charges/")
    return request


def test_a_repeated_form_field_counts_its_order_but_fields_do_not() -> None:
    """A view reading getlist("recipient") sees the order of the values."""
    alice_first = keys.fingerprint(_form({"recipient": ["alice", "bob"], "amount": "5"}))
    bob_first = keys.fingerprint(_form({"recipient": ["bob", "alice"], "amount": "5"}))
    reordered_fields = keys.fingerprint(_form({"amount": "5", "recipient": ["alice", "bob"]}))
    assert alice_first != bob_first
    assert alice_first == reordered_fields


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
    assert keys.bounded("user:1") == "user:1"
    assert len(keys.bounded(long_a)) <= 255
    assert keys.bounded(long_a) != keys.bounded(long_b)


@pytest.mark.parametrize("hashed", ["t" * 256, "a\x00b", "sha256:x", "sha256:" + "0" * 64])
def test_no_text_kept_as_it_is_equals_another_texts_hash(hashed: str) -> None:
    """A short text spelled like a hash is hashed itself: the mapping is
    one to one (a scope "sha256:<hex>" never meets the long scope it names)."""
    spelled_like_its_hash = keys.bounded(hashed)
    assert spelled_like_its_hash.startswith("sha256:") and len(spelled_like_its_hash) == 71
    assert keys.bounded(spelled_like_its_hash) != spelled_like_its_hash
    assert keys.bounded("sha256") == "sha256" and keys.bounded("SHA256:x") == "SHA256:x"
    assert keys.bounded("x" * 255) == "x" * 255, "the stored form of other text is unchanged"
