"""The shared JSON decoder/encoder must behave exactly as the
json.loads/json.dumps calls they replaced, also under threads."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import orjson
import pytest

from idempotency_app.http import keys


def _old_decode(text: str) -> Any:
    return json.loads(
        text, parse_constant=keys._refuse, parse_float=orjson.Fragment, parse_int=orjson.Fragment
    )


def _outcome(fn: Any, text: str) -> Any:
    try:
        data = fn(text)
    except (ValueError, LookupError, RecursionError) as exc:
        return ("error", type(exc).__name__ in ("RecursionError",))
    try:
        return ("ok", orjson.dumps(data, option=orjson.OPT_SORT_KEYS))
    except TypeError:
        return ("typeerror",)


CASES = [
    '{"a": 1}',
    '\ufeff{"a": 1}',
    '{"a": NaN}',
    '{"a": Infinity}',
    "[-Infinity]",
    '{"a": 1e400}',
    '{"a": -0}',
    '{"a": 0.10000000000000000000001}',
    "[1E5, 1e-5, -0.0]",
    "12345678901234567890123456789",
    '"\\ud800"',
    '{"a":1,"a":2}',
    ' \n\t{"b":[]} \r\n',
    '{"a": 1} x',
    "",
    " ",
    "nul",
    "true",
    "[" * 100000 + "]" * 100000,
    "[" * 300 + "]" * 300,
    '{"\\u0000": "\\u2028"}',
    '{"a": 01}',
    '{"a": .5}',
    "[1,]",
    '{"a": "\x00"}',
    '{"a": 1}\ufeff',
]


@pytest.mark.parametrize("text", CASES, ids=range(len(CASES)))
def test_same_as_json_loads(text: str) -> None:
    assert _outcome(keys._DECODE_KEEPING_NUMBERS, text) == _outcome(_old_decode, text)


def test_random_same_as_json_loads() -> None:
    rnd = random.Random(7)
    alphabet = '{}[]:,"0123456789-+.eE ntrufalsNIy\\u\ufeff\t\n'
    for _ in range(20000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))
        assert _outcome(keys._DECODE_KEEPING_NUMBERS, text) == _outcome(_old_decode, text), text


def test_encoder_same_as_dumps() -> None:
    import datetime
    import decimal
    import uuid

    values = [
        [],
        [["a", 1]],
        [
            [uuid.UUID(int=5), decimal.Decimal("1.10"), datetime.date(2020, 1, 1)],
            [("k", float("nan")), ("z", "é\u2028")],
        ],
    ]
    for v in values:
        assert keys._encode_url_args(v) == json.dumps(v, default=str)


def test_shared_decoder_under_threads() -> None:
    texts = [
        json.dumps({f"k{i}_{j}": [j, j * 1.5, {"x" * j: str(i)}] for j in range(30)})
        for i in range(16)
    ]
    expected = [_outcome(_old_decode, t) for t in texts]
    errors: list[Any] = []
    barrier = threading.Barrier(16)

    def run(i: int) -> None:
        barrier.wait()
        for _ in range(300):
            got = _outcome(keys._DECODE_KEEPING_NUMBERS, texts[i])
            if got != expected[i]:
                errors.append((i, got))
                return

    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
