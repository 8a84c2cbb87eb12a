"""``assert_idempotent``: prove, in an integrator's own test suite, that an
endpoint is safe to retry.

::

    from idempotency_app.testing import assert_idempotent

    @pytest.mark.django_db(transaction=True)
    def test_charges_are_idempotent(api_client, account):
        assert_idempotent(
            api_client, f"/api/accounts/{account.pk}/charges/", {"amount": 2500},
            effects=lambda: Charge.objects.count(),
        )

It sends JSON bodies through a Django test client (``django.test.Client``
or DRF's ``APIClient``, authenticated as the test needs) and checks, with
fresh keys:

1. the first request is answered (no 5xx), stored (``Idempotency-Expires``)
   and not a replay;
2. the same request again is its replay: same status and body, marked
   ``Idempotent-Replayed: true``;
3. the same key with another body is refused with 422;
4. ``concurrent`` identical requests sent at once from threads run once:
   one runs, the others replay it or are refused without running (409
   ``request_in_progress``, or 503 when the database could not arbitrate).
   A round in which every copy was refused (409 or 503) ran nothing and is
   sent again with a new key, up to five rounds; two copies that run
   fail at once.

``effects`` (optional) counts what the endpoint does (rows it creates, say):
it must grow by exactly one per key. The concurrent requests use their own
database connections, so they only see committed data: use
``transactional_db`` (``django_db(transaction=True)``) or
``TransactionTestCase``, or pass ``concurrent=0``.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections

from idempotency_app.conf import conf
from idempotency_app.http.replay import EXPIRES_HEADER, REPLAYED_HEADER

METHODS = ("post", "put", "patch", "delete")
ROUNDS = 5  # of concurrent duplicates, while every copy is refused


@dataclass(frozen=True)
class Proof:
    """The responses the proof rests on, for further assertions."""

    first: Any
    replay: Any
    mismatch: Any
    concurrent: list[Any]


def assert_idempotent(
    client: Any,
    url: str,
    data: Any,
    *,
    method: str = "post",
    changed: Any = None,
    concurrent: int = 2,
    effects: Callable[[], int] | None = None,
    **extra: Any,
) -> Proof:
    """Raise ``AssertionError`` unless ``url`` replays, refuses a reused key
    and runs once under concurrent duplicates (see the module docstring).
    ``extra`` goes to every request (``HTTP_ACCEPT=...``, ``headers=...``)."""
    method = method.lower()
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {', '.join(METHODS)}.")
    if changed is None:
        if not isinstance(data, dict):
            raise ValueError("Pass changed=: a body other than data, to reuse the key with.")
        changed = {**data, "idempotency_probe": "a different request"}
    if changed == data:
        raise ValueError("changed= must differ from data.")
    if concurrent == 1 or concurrent < 0:
        raise ValueError("concurrent= is the number of duplicates sent at once: 0, or 2 and more.")
    if concurrent and any(connections[alias].in_atomic_block for alias in connections):
        raise RuntimeError(
            "assert_idempotent sends its concurrent duplicates from threads, whose database "
            "connections cannot see this test's uncommitted data: use transactional_db "
            "(django_db(transaction=True)) or TransactionTestCase, or pass concurrent=0."
        )
    counted = _Effects(effects)

    key = str(uuid.uuid4())
    first = _send(client, method, url, data, key, extra)
    _expect(first.status_code < 500, first, f"The first request failed with {first.status_code}")
    _expect(REPLAYED_HEADER not in first, first, "The first request with a new key was a replay")
    _expect(
        EXPIRES_HEADER in first,
        first,
        f"The first request's {first.status_code} was not stored (no {EXPIRES_HEADER} header): is "
        f"{method.upper()} {url} covered by @idempotent or IdempotentMixin, and does it "
        "accept this body?",
    )
    replay = _send(client, method, url, data, key, extra)
    _expect(
        replay.status_code == first.status_code and replay.get(REPLAYED_HEADER) == "true",
        replay,
        f"The retry got {replay.status_code} ({REPLAYED_HEADER}: {replay.get(REPLAYED_HEADER)}), "
        f"not a replay of the first {first.status_code}",
    )
    _expect(replay.content == first.content, replay, "The replay's body differs from the first")
    mismatch = _send(client, method, url, changed, key, extra)
    _expect(
        mismatch.status_code == 422,
        mismatch,
        f"The key reused with another body got {mismatch.status_code}, not 422",
    )
    counted.expect(1, "a request, its retry and the key reused with another body")

    duplicates: list[Any] = []
    if concurrent:
        duplicates, ran = _duplicates_until_one_runs(
            concurrent, client, method, url, data, extra, counted
        )
        for other in duplicates:
            if other is ran[0]:
                continue
            if not _refused(other):
                _expect(
                    other.status_code == ran[0].status_code and other.content == ran[0].content,
                    other,
                    "A concurrent duplicate's replay differs from the response that ran",
                )
    return Proof(first, replay, mismatch, duplicates)


def _duplicates_until_one_runs(
    concurrent: int,
    client: Any,
    method: str,
    url: str,
    data: Any,
    extra: dict[str, Any],
    counted: _Effects,
) -> tuple[list[Any], list[Any]]:
    """Send ``concurrent`` copies of a request with a new key at once; never
    may two of them run. A round in which every copy was refused ran nothing
    and proves nothing: SQLite's shared-cache test databases answer
    concurrent writers with "database table is locked", which refuses the
    claim (503) or rolls back the winner's work at its COMMIT (500). It is
    sent again with another key, up to ``ROUNDS`` rounds, unless the
    effects grew: then their count says how often it ran."""
    for _ in range(ROUNDS):

        def send_copy(c: Any, key: str = str(uuid.uuid4())) -> Any:
            return _send(c, method, url, data, key, extra)

        duplicates = _at_once(concurrent, send_copy, client)
        ran = [r for r in duplicates if not _refused(r) and REPLAYED_HEADER not in r]
        statuses = [r.status_code for r in duplicates]
        _expect(
            len(ran) <= 1,
            ran[-1] if ran else duplicates[0],
            f"{concurrent} concurrent duplicates ran {len(ran)} times (statuses {statuses})",
        )
        if ran or counted.grew():
            break
    counted.expect(1, f"{concurrent} concurrent duplicates")
    _expect(
        len(ran) == 1,
        duplicates[0],
        f"{concurrent} concurrent duplicates ran {len(ran)} times (statuses {statuses})",
    )
    return duplicates, ran


def _refused(response: Any) -> bool:
    """Answered without keeping anything: 409 ``request_in_progress``, or
    503 ``idempotency_store_unavailable`` (the database could not arbitrate
    the claim, as SQLite's shared-cache test databases do under concurrent
    writers: "database table is locked"), both with ``Retry-After``; or 500
    ``request_rolled_back`` (the same lock met by the winner's COMMIT). The
    effects count still catches a rolled-back answer whose work was kept."""
    if response.status_code == 500:
        return b"request_rolled_back" in response.content
    return response.status_code in (409, 503) and "Retry-After" in response


def _send(client: Any, method: str, url: str, data: Any, key: str, extra: dict[str, Any]) -> Any:
    headers = {**extra.get("headers", {}), conf.HEADER: key}
    rest = {name: value for name, value in extra.items() if name != "headers"}
    return getattr(client, method)(
        url, json.dumps(data), content_type="application/json", headers=headers, **rest
    )


def _expect(condition: bool, response: Any, message: str) -> None:
    if not condition:
        body = response.content[:500].decode("utf-8", "replace")
        raise AssertionError(f"{message}. Response {response.status_code}: {body}")


class _Effects:
    def __init__(self, count: Callable[[], int] | None) -> None:
        self.count = count
        self.last = count() if count is not None else 0

    def grew(self) -> bool:
        return self.count is not None and self.count() != self.last

    def expect(self, grown: int, what: str) -> None:
        if self.count is None:
            return
        now = self.count()
        if now - self.last != grown:
            raise AssertionError(
                f"effects grew by {now - self.last}, not {grown}, for {what}: the work ran "
                f"{now - self.last} times."
            )
        self.last = now


def _at_once(count: int, send: Callable[[Any], Any], client: Any) -> list[Any]:
    """``send`` from ``count`` threads released together, each with its own
    copy of ``client`` (same credentials) and its own connections."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def worker(index: int, own: Any) -> None:
        try:
            barrier.wait(timeout=30)
            results[index] = send(own)
        except BaseException as exc:  # handed to the caller's thread
            results[index] = exc
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=worker, args=(i, _copy(client)), daemon=True) for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for result in results:
        if isinstance(result, BaseException):
            raise AssertionError(f"A concurrent duplicate raised {result!r}") from result
        if result is None:
            raise AssertionError("A concurrent duplicate did not finish within 120 seconds.")
    return results


def _copy(client: Any) -> Any:
    """A client for another thread: the same credentials and cookies, no
    shared mutable state."""
    own = copy.copy(client)
    own.handler = copy.copy(client.handler)
    own.cookies = copy.copy(client.cookies)
    if hasattr(client, "_credentials"):  # DRF's APIClient
        own._credentials = dict(client._credentials)
    return own
