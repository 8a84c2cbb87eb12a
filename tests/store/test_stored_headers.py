"""The stored headers' JSON, written by orjson where its text is ASCII and by
the standard library otherwise: every header list must read back as it was
stored, and the column must be the very text the standard library writes,
ASCII, whatever the values (rows stored before and after read and display
alike, and a process still on older code reads them)."""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from idempotency_app.store.base import StoredResponse, parse_headers

STANDARD = json.JSONEncoder(separators=(",", ":")).encode

any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
ascii_text = st.text(st.characters(max_codepoint=0x7F), max_size=20)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(any_text, any_text), max_size=5))
def test_any_headers_read_back_as_stored_from_ascii_text(pairs: list[tuple[str, str]]) -> None:
    headers = tuple(pairs)
    written = StoredResponse(201, headers, b"").headers_json()
    assert written.isascii()
    assert parse_headers(written) == headers
    assert written == STANDARD([list(pair) for pair in headers])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ascii_text, ascii_text), max_size=5))
def test_ascii_headers_are_written_as_the_standard_library_writes_them(
    pairs: list[tuple[str, str]],
) -> None:
    headers = tuple(pairs)
    assert StoredResponse(201, headers, b"").headers_json() == STANDARD([list(p) for p in headers])


def test_what_only_the_standard_library_reads_is_still_read() -> None:
    """Rows written by the standard library: an escaped lone surrogate and an
    integer past 64 bits, which orjson refuses."""
    assert parse_headers('[["X-A","\\ud800"]]') == (("X-A", "\ud800"),)
    assert parse_headers('[["X-B",18446744073709551616]]') == (("X-B", "18446744073709551616"),)
    assert parse_headers('[["X-C",1.50],[7,null]]') == (("X-C", "1.5"), ("7", "None"))
    assert parse_headers(None) == ()
    assert parse_headers("") == ()
    for broken in ('[["X-D","a","b"]]', "[5]", "{"):
        with pytest.raises((ValueError, TypeError)) as new:
            parse_headers(broken)
        with pytest.raises((ValueError, TypeError)) as standard:
            tuple((str(n), str(v)) for n, v in json.loads(broken))
        assert type(new.value) is type(standard.value)


@pytest.mark.parametrize("value", ["caf\u00e9", "\ud800", "a\x7fb", "\x01\x1f\t", '\\ " / %s', ""])
def test_odd_values_are_written_as_the_standard_library_writes_them(value: str) -> None:
    """DEL is ASCII but only the standard library escapes it (found by a review)."""
    headers = (("Content-Disposition", value),)
    written = StoredResponse(200, headers, None).headers_json()
    assert written == STANDARD([list(pair) for pair in headers])
    assert parse_headers(written) == headers


@pytest.mark.parametrize(
    "headers",
    [
        (("X-Id", uuid.UUID(int=1)),),
        (("Date", datetime.datetime(2026, 1, 1)),),
        (("X-N", 1e16),),
        ("ab",),
        ({"X": "y"},),
        (("X-A", "b", "c"),),
    ],
    ids=["uuid", "datetime", "float", "pair-is-str", "pair-is-dict", "three"],
)
def test_what_is_not_pairs_of_text_is_written_or_refused_as_before(headers: Any) -> None:
    """Found by a review: orjson writes a UUID or a datetime the standard
    library refuses, and a pair that is a string or a dict otherwise."""

    def outcome(write: Any) -> Any:
        try:
            return ("ok", write())
        except Exception as exc:
            return ("raised", type(exc))

    assert outcome(StoredResponse(200, headers, None).headers_json) == outcome(
        lambda: STANDARD([list(pair) for pair in headers])
    )
