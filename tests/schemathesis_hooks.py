"""Schemathesis hooks for the contract run against the example project
(``.ci/openapi-contract``): authenticate, send keys, and check the
protocol itself.

- Every request is made as the demo user alice (HTTP Basic).
- A key the schema allows is replaced with a fresh UUID before each call,
  so that generated requests are first requests that run; malformed keys
  (negative tests) are kept, to be refused with 400.
- ``retry_replays``: a request that sent a key and was stored is sent again,
  byte for byte, as a client's retry would be, and must come back as a
  replay of the same status and body, without running again.

Loaded with ``SCHEMATHESIS_HOOKS=tests.schemathesis_hooks``; it imports
schemathesis only, never Django.
"""

from __future__ import annotations

import base64
import re
import uuid
from typing import Any

import requests
import schemathesis

HEADER = "Idempotency-Key"
# The header's pattern in the schema (idempotency_app.openapi.KEY_PATTERN).
VALID_KEY = re.compile(r"^[!#-~](?:[ -~]{0,253}[!#-~])?$")
USER = ("alice", "alice")


@schemathesis.auth()
class DemoUser:
    def get(self, case: Any, ctx: Any) -> str:
        return base64.b64encode(":".join(USER).encode()).decode()

    def set(self, case: Any, data: str, ctx: Any) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Basic {data}"}


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Every phase, examples included (whose key would otherwise be the
    schema's one example, reused with other bodies: a 422)."""
    headers = case.headers or {}
    if isinstance(headers.get(HEADER), str) and VALID_KEY.match(headers[HEADER]):
        case.headers = {**headers, HEADER: str(uuid.uuid4())}


@schemathesis.check
def retry_replays(ctx: Any, response: Any, case: Any) -> None:
    """A success sent with a key was stored (it says until when), and a
    retry of any stored outcome gets that outcome back, marked replayed.
    Answers given before the layer runs (authentication, a method the
    operation does not have) are not stored, and carry no expiry."""
    request = response.request
    key = request.headers.get(HEADER)
    headers = response.headers  # lower-cased names, lists of values
    if key is None or request.method != case.method.upper() or "idempotent-replayed" in headers:
        return
    if 200 <= response.status_code < 300 and "idempotency-expires" not in headers:
        raise AssertionError(
            f"A {response.status_code} sent with key {key!r} has no Idempotency-Expires: "
            "it was not stored, so a retry would run it again."
        )
    if "idempotency-expires" not in headers:
        return
    with requests.Session() as session:
        retry = session.send(request.copy(), timeout=30)
    replayed = retry.headers.get("Idempotent-Replayed")
    if retry.status_code != response.status_code or replayed != "true":
        raise AssertionError(
            f"A retry with key {key!r} got {retry.status_code} (Idempotent-Replayed: "
            f"{replayed}), not a replay of the first answer, {response.status_code}."
        )
    if retry.content != response.content:
        raise AssertionError(f"The replay of key {key!r} has a different body.")
