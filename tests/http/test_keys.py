from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

import pytest
from django.test import RequestFactory
from django.test.utils import override_settings
from django.urls import resolve
from hypothesis import given, settings, strategies as st
from rest_framework.exceptions import ParseError

from idempotency_app.http import keys


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


def _framed(*parts: bytes) -> str:
    """The fingerprint's hash as records already stored were made: each
    part's length in 8 bytes, then the part, fed to SHA-256 one by one."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


@pytest.mark.parametrize(
    ("path", "url_args"),
    [
        ("/charges/", b"[[], []]"),
        ("/accounts/7/charges/", b'[[], [["account", 7]]]'),
        ("/no/such/route/", b"[]"),
    ],
)
def test_the_fingerprint_of_a_stored_record_still_matches_its_retry(
    path: str, url_args: bytes
) -> None:
    """A record stored by an earlier version is matched by its retry after
    an upgrade: the fingerprint is the same hash of the same parts."""
    request = _request("/charges/", b'{"b": 1, "a": 2.50}')
    if path == "/no/such/route/":
        request.resolver_match = None
        request.path_info = path
        operation = b"POST /no/such/route/"
    else:
        request = _request(path, b'{"b": 1, "a": 2.50}')
        operation = keys.operation(request).encode()
    expected = _framed(operation, url_args, b"raw", b'{"a":2.50,"b":1}')
    assert keys.fingerprint(request) == expected
    assert keys.identity_fingerprint(request, expected) == _framed(
        b"application/json", expected.encode()
    )


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


def test_the_same_text_escaped_or_not_is_one_request() -> None:
    escaped = b'{"label": "Jos\\u00e9", "ref": "12345678901234567890", "n": [5, -7]}'
    raw = '{"n": [5, -7], "label": "José", "ref": "123456789\\u00301234567890"}'.encode()
    assert keys.fingerprint(_request("/charges/", escaped)) == keys.fingerprint(
        _request("/charges/", raw)
    )


@pytest.mark.parametrize(
    ("one", "two"),
    [
        pytest.param("12.345678901234567891", "12.345678901234567899", id="past-float-precision"),
        pytest.param("12.50", "12.5", id="trailing-zero"),
        pytest.param("1E2", "100", id="exponent"),
        pytest.param("1e2", "1E2", id="exponent-case"),
        pytest.param("1.0", "1", id="integral-fraction"),
        pytest.param("-0", "0", id="negative-zero"),
        pytest.param("-0.0", "0.0", id="negative-zero-fraction"),
        pytest.param("0.1", "1e-1", id="fraction-or-exponent"),
        pytest.param("20000000000000000000", "2e19", id="beyond-64-bits"),
        pytest.param("1e400", "1e401", id="both-infinite-as-floats"),
    ],
)
def test_numbers_count_as_written(one: str, two: str) -> None:
    """Numbers a view could read apart (as Decimal, say) are two requests,
    even where a float cannot tell them apart. Decided: 12.50 and 12.5 too."""

    def fp(amount: str, other: str) -> str:
        return keys.fingerprint(_request("/charges/", f'{{"amount": {amount}, "other": {other}}}'))

    assert fp(one, "1") != fp(two, "1")
    assert fp("1", one) != fp("1", two)


def test_numbers_as_written_still_ignore_key_order_and_whitespace() -> None:
    first = b'{"amount": 12.50, "fees": [1E2, -0, 20000000000000000000, 0.1], "a": "x"}'
    second = b'{ "a" : "x" ,\n "fees":[1E2,-0,20000000000000000000,0.1],"amount":12.50 }'
    assert keys.fingerprint(_request("/charges/", first)) == keys.fingerprint(
        _request("/charges/", second)
    )
    assert keys.canonical_body(_request("/charges/", first), first) == (
        b'{"a":"x","amount":12.50,"fees":[1E2,-0,20000000000000000000,0.1]}'
    )


@pytest.mark.parametrize(
    ("one", "same", "other"),
    [
        pytest.param(
            '{"a": "\\ud800", "n": 12.50}',
            '{ "n" : 12.50 , "a" : "\\ud800" }',
            '{"a": "\\ud800", "n": 12.5}',
            id="surrogate",
        ),
        pytest.param(
            '{"\\udc80": 1.0, "b": 1}', '{"b":1,"\\udc80":1.0}', '{"\\udc80": 1, "b": 1}', id="key"
        ),
        pytest.param(
            "[" * 300 + '{"a": 1.0, "b": 2}' + "]" * 300,
            "[" * 300 + '{"b":2,"a":1.0}' + "]" * 300,
            "[" * 300 + '{"a": 1, "b": 2}' + "]" * 300,
            id="deeper-than-orjson-writes",
        ),
    ],
)
def test_numbers_count_as_written_where_orjson_cannot_write(
    one: str, same: str, other: str
) -> None:
    """Data orjson refuses to write takes the standard library's form,
    numbers still as written, key order and whitespace still not counted."""

    def canonical(text: str) -> bytes:
        return keys.canonical_body(_request("/charges/", text), text.encode())

    assert canonical(one) == canonical(same)
    assert canonical(one) != canonical(other)
    assert canonical(one) != one.encode(), "parsed, not hashed as its bytes"


@pytest.mark.parametrize(
    "refused, accepted",
    [
        (b'\xef\xbb\xbf{"amount": 2500}', b'{"amount": 2500}'),  # a UTF-8 BOM
        ('{"amount": 2500}'.encode("utf-16"), b'{"amount": 2500}'),
        (b'{"amount": NaN}', b'{"amount": null}'),
        (b'{"amount": -Infinity}', b'{"amount": null}'),
    ],
)
def test_a_body_the_view_refuses_is_not_the_corrected_one(refused: bytes, accepted: bytes) -> None:
    """DRF refuses these (400): fingerprinted as their bytes, never as the
    corrected body."""
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


def test_text_that_differs_only_in_surrogates_hashes_apart() -> None:
    """Lone surrogates are hashed as what they are, not as the bytes they
    may stand for ("\\udcc3\\udca9" for the UTF-8 of "é"), and a short text
    holding one (which no database stores) is hashed too."""
    pad = "x" * 300
    assert keys.bounded("\u00e9" + pad) != keys.bounded("\udcc3\udca9" + pad)
    assert keys.bounded("\ud800").startswith("sha256:")
    assert keys.bounded("\ud800") != keys.bounded("\udfff")
    assert keys.bounded("caf\u00e9") == "caf\u00e9"
    assert keys.bounded("\u00e9" + pad) == (
        "sha256:" + hashlib.sha256(("\u00e9" + pad).encode()).hexdigest()
    ), "the hash of other text is unchanged"


@pytest.mark.parametrize("value", ["", "0", "13", " 13\t", "9" * 40])
def test_content_length_is_read_as_digits(value: str) -> None:
    request = RequestFactory().post("/charges/", b"", content_type="application/json")
    request.META["CONTENT_LENGTH"] = value
    assert keys.content_length(request) == int(value.strip() or 0)


@pytest.mark.parametrize(
    "value", ["13abc", "-1", "+13", "1_3", "1.5", "0x10", "\u0661\u0663", "1 3", "9" * 5000]
)
def test_a_content_length_that_is_not_digits_is_a_parse_error(value: str) -> None:
    """Not a 500 (int() refuses some), nor a number Django reads otherwise."""
    request = RequestFactory().post("/charges/", b"", content_type="application/json")
    request.META["CONTENT_LENGTH"] = value
    with pytest.raises(ParseError, match="Content-Length"):
        keys.content_length(request)


# -- the fingerprint against every way of writing the same JSON --------------------

_NUMBERS = st.from_regex(
    r"-?(0|[1-9][0-9]{0,22})(\.[0-9]{1,22})?([eE][-+]?[0-9]{1,3})?", fullmatch=True
)
_TEXT = st.text(st.characters() | st.sampled_from(["\ud800", "\udc80", "\udfff", "\x00", "\\"]))


@dataclass(frozen=True)
class _Number:
    """A number as written."""

    text: str


_DOCS = st.recursive(
    st.none() | st.booleans() | _TEXT | _NUMBERS.map(_Number),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


def _render(value: Any, rnd: Any) -> str:
    """``value`` as JSON text, with key order, whitespace and escaping left to chance."""
    space = rnd.choice(["", " ", "\n  ", "\t"])
    if isinstance(value, _Number):
        return value.text
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        inner = f",{space}".join(
            f"{_render(k, rnd)}{space}:{space}{_render(v, rnd)}" for k, v in items
        )
        return "{" + space + inner + space + "}"
    if isinstance(value, list):
        return "[" + space + f"{space},".join(_render(v, rnd) for v in value) + space + "]"
    return json.dumps(
        value, ensure_ascii=rnd.random() < 0.5 or (isinstance(value, str) and _has_surrogate(value))
    )


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def _canonical(text: str) -> bytes:
    body = text.encode("utf-8")
    return keys.canonical_body(_request("/charges/", body), body)


def _as_written(text: str) -> Any:
    """The finest reading any parser can make: numbers as their text."""
    return json.loads(text, parse_float=_Number, parse_int=_Number)


def _variants(number: str) -> list[str]:
    """Other ways to write the same value as a float (or as a Decimal's value)."""
    mantissa, e, exponent = number.replace("E", "e").partition("e")
    out = [mantissa + ("0" if "." in mantissa else ".0") + e + exponent]
    out += [number.swapcase()] if e else [number + "e0", number + "E0"]
    if mantissa.lstrip("-").strip("0.") == "":
        out.append(number[1:] if number.startswith("-") else "-" + number)
    return out


def _numbers_in(value: Any) -> list[tuple[Any, Any]]:
    """(container, index or key) of every number in ``value``."""
    found: list[tuple[Any, Any]] = []
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else []
    )
    for where, item in items:
        if isinstance(item, _Number):
            found.append((value, where))
        else:
            found.extend(_numbers_in(item))
    return found


PROPERTY = settings(max_examples=300, deadline=None, database=None)


@PROPERTY
@given(_DOCS, st.integers(), st.integers())
def test_any_two_writings_of_the_same_json_are_one_request(doc: Any, one: int, two: int) -> None:
    first, second = _render(doc, random.Random(one)), _render(doc, random.Random(two))
    assert _as_written(first) == _as_written(second)
    assert _canonical(first) == _canonical(second)


@PROPERTY
@given(_DOCS, st.integers(), st.data())
def test_a_number_written_otherwise_is_another_request(doc: Any, seed: int, data: Any) -> None:
    """Whatever the data around it, one number written otherwise (12.5 as
    12.50, 1.25E1 or 12.5e0; 0 as -0) is another request."""
    doc = [copy.deepcopy(doc), _Number("12.5")]
    text = _render(doc, random.Random(seed))
    container, where = data.draw(st.sampled_from(_numbers_in(doc)))
    container[where] = _Number(data.draw(st.sampled_from(_variants(container[where].text))))
    changed = _render(doc, random.Random(seed))
    assert _as_written(text) != _as_written(changed)
    assert _canonical(text) != _canonical(changed)
