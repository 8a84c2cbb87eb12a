"""Identities and results: checked before anything touches the database,
stored as JSON that comes back equal."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from idempotency_app.conf import conf
from idempotency_app.http import keys
from idempotency_app.store import Identity, StoredResponse

# What a task's result was stored as before 0.2, which still reads back.
LEGACY_RESULT = (200, (("Content-Type", "application/json"),))
# The status the ``executed`` signal reports for a task, as for a view's 200.
TASK_STATUS = 200


def make_identity(scope: str, key: str | int, operation: str, fingerprint: Any = None) -> Identity:
    """Check the parts before anything touches the database.

    ``fingerprint`` is any JSON value describing what the work is asked to
    do; it is hashed, never stored. None means "no fingerprint": later calls
    must also pass None, or they are a different request (KeyReused).
    """
    if not isinstance(scope, str):
        raise TypeError(f"An idempotency scope must be a string, not {scope!r}.")
    if not scope:
        raise ValueError("An idempotency scope must not be empty.")
    if isinstance(key, int) and not isinstance(key, bool):
        key = str(key)
    if not isinstance(key, str):
        raise TypeError(f"An idempotency key must be a string or an int, not {key!r}.")
    if not key:
        raise ValueError("An idempotency key must not be empty.")
    if len(key) > keys.MAX_KEY_LENGTH:
        raise ValueError(
            f"An idempotency key may be {keys.MAX_KEY_LENGTH} characters at most; "
            "hash longer ones first."
        )
    if "\x00" in key:
        raise ValueError("An idempotency key must not contain NUL; PostgreSQL cannot store it.")
    if not key.isascii() and any("\ud800" <= ch <= "\udfff" for ch in key):
        raise ValueError(
            "An idempotency key must not hold a lone surrogate, which no database encoding "
            "can store; hash such a key first."
        )
    if not isinstance(operation, str) or len(operation) > 255 or "\x00" in operation:
        raise ValueError("An operation must be a string of 255 characters at most, without NUL.")
    digest = (
        ""
        if fingerprint is None
        else hashlib.sha256(encode(fingerprint, "fingerprint")).hexdigest()
    )
    return Identity(keys.bounded(scope), key, operation, digest)


def encode(value: Any, name: str = "result") -> bytes:
    """Compact JSON, refusing what would not come back equal."""
    _check_json(value, name)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def _check_json(value: Any, path: str) -> None:
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{path} is {value!r}: JSON has no NaN or infinity.")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_json(item, f"{path}[{index}]")
        return
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{path} has the key {name!r}: JSON object keys must be strings.")
            _check_json(item, f"{path}[{name!r}]")
        return
    raise TypeError(
        f"{path} is a {type(value).__name__}, which JSON cannot hold; convert it "
        "(str() for Decimal, UUID or datetime, a list for a set, an id for a model)."
    )


def decode(response: StoredResponse) -> Any:
    """The result a record holds: JSON, with no response status."""
    result = response.status is None or (response.status, response.headers) == LEGACY_RESULT
    if response.body is None or not result:
        raise ValueError("This record was not stored by the service API: it holds no JSON result.")
    return json.loads(response.body)


def stored_result(body: bytes) -> StoredResponse:
    if len(body) > conf.MAX_BODY_BYTES:
        raise ValueError(
            f"The result is {len(body)} bytes of JSON, above MAX_BODY_BYTES "
            f"({conf.MAX_BODY_BYTES}); return a reference such as an id instead."
        )
    return StoredResponse(None, (), body)
