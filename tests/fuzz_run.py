"""A long fuzz run: generated requests, in process, against the test project.

    IDEMPOTENCY_TEST_DB=postgres IDEMPOTENCY_TEST_DB_NAME=fuzz \\
    IDEMPOTENCY_TEST_REDIS_URL=redis://127.0.0.1:6379/0 \\
    .venv/bin/python tests/fuzz_run.py --requests 100000

The backend comes from the same variables as the test suite; a test database
``test_<IDEMPOTENCY_TEST_DB_NAME>`` is created and dropped. Users share a pool
of keys and often send identical bodies, so a response served across scopes
would be noticed. Every request is checked:

- no 5xx unless the body asked the view for it, or Django/DRF fail the same
  request identically without a key (counted apart as framework failures);
- an invalid key on a covered method is refused with idempotency_key_invalid;
- a replay of a stored response is byte-identical to the response stored for
  the same user and key, and a cached 400 is one that user was sent;
- no response names another user's label.

Prints status counts, outcomes, rows and cache entries left, and requests/s.
Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import uuid
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core.cache import caches  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart  # noqa: E402
from django.test.utils import (  # noqa: E402
    setup_databases,
    setup_test_environment,
    teardown_databases,
    teardown_test_environment,
)
from rest_framework.test import APIClient  # noqa: E402

from idempotency_app.http.keys import CANONICAL_JSON_MAX_BYTES  # noqa: E402
from idempotency_app.models import IdempotencyRecord  # noqa: E402

RETRIES = 0.33  # the share of requests that repeat a recent one exactly
COPIES = 0.07  # the share that send another user's recent key and body
PLAIN = [c for c in range(0x21, 0x7F) if c != ord('"')]
POOL = 1000  # shared keys: every user draws from the same few
LABELS = 30  # body variants per user, so retries of one intent are common
STORED_STATUSES_ASKED = (200, 201, 202, 204, 301, 403, 404, 410, 422)
RELEASED_STATUSES_ASKED = (400, 409, 429, 500, 502, 503)
ODD_TYPES = (
    "",
    "text/plain",
    "application/octet-stream",
    "application/json; charset=bogus",
    "application/json; charset=rot13",
    "application/json; charset=utf-16",
    "application/json; charset=",
    "application/vnd.api+json",
    "multipart/form-data",
    "multipart/form-data; boundary=",
    ";;;===",
)
ACCEPTS = (
    "*/*",
    "application/json",
    "text/html",
    "application/xml",
    "",
    "application/json, text/html",
)
QUERIES = ("format=json", "format=api", "format=bogus", "q=1&q=2", "%ff%00=%", "a=" + "b" * 2000)


@dataclass
class Planned:
    uid: int | None  # None: anonymous
    method: str
    path: str
    covered: bool
    key: str | None  # the header as sent
    norm: str | None  # the key it stands for; "" when invalid
    body: bytes
    content_type: str
    asked: int | None = None
    headers: dict[str, str] = field(default_factory=dict)


class Generator:
    """Seeded, so a failing run can be repeated exactly."""

    def __init__(self, seed: int, users: list[int]) -> None:
        self.rng = random.Random(seed)
        self.users = users
        self.recent: deque[Planned] = deque(maxlen=200)

    def plan(self) -> Planned:
        """A retry of a recent request a third of the time; sometimes another
        user's recent request, key and body unchanged; else a new one."""
        roll = self.rng.random()
        if self.recent and roll < RETRIES:
            return self.rng.choice(self.recent)
        if self.recent and roll < RETRIES + COPIES:
            planned = replace(self.rng.choice(self.recent), uid=self.rng.choice(self.users))
        else:
            planned = self.fresh()
        self.recent.append(planned)
        return planned

    def fresh(self) -> Planned:
        r = self.rng
        uid: int | None = r.choice(self.users)
        roll = r.random()
        if roll < 0.40:
            method, path, covered = "POST", "/charges/", True
        elif roll < 0.50:
            method, path, covered = "POST", f"/accounts/{r.randint(1, 3)}/charges/", True
        elif roll < 0.72:
            method = r.choice(["POST", "POST", "PATCH", "PUT"])
            path, covered = "/mixin-charges/", method != "PUT"
        elif roll < 0.90:
            method, path, covered = "POST", "/viewset-charges/", True
        elif roll < 0.96:
            method, path, covered = "POST", f"/viewset-charges/{r.randint(1, 60)}/refund/", True
        else:
            method, path, covered, uid = "POST", "/charges-anonymous/", True, None
        key, norm = self.key()
        body, content_type, asked = self.body(uid)
        headers: dict[str, str] = {}
        if r.random() < 0.03:
            headers["HTTP_ACCEPT"] = r.choice(ACCEPTS)
        if r.random() < 0.03:
            headers["QUERY_STRING"] = r.choice(QUERIES)
        if r.random() < 0.02:
            headers["HTTP_X_FORWARDED_FOR"] = self.latin1(r.randint(0, 40))
        return Planned(uid, method, path, covered, key, norm, body, content_type, asked, headers)

    def latin1(self, n: int) -> str:
        return bytes(self.rng.randrange(256) for _ in range(n)).decode("latin-1")

    def key(self) -> tuple[str | None, str | None]:
        r = self.rng
        roll = r.random()
        if roll < 0.10:
            return None, None
        if roll < 0.55:
            k = f"k-{r.randrange(POOL)}"
            return k, k
        if roll < 0.60:
            k = f"k-{r.randrange(POOL)}"
            return f' "{k}"\t', k  # a Structured-Field string, with whitespace around
        if roll < 0.72:
            k = str(uuid.uuid4())
            return k, k
        if roll < 0.80:
            # Any printable ASCII but the quote, so the value is the key as sent.
            k = "".join(chr(r.choice(PLAIN)) for _ in range(r.randint(1, 255)))
            return k, k
        bad = r.choice(
            [
                "",
                "   ",
                "k" * r.randint(256, 400),
                "bad\x01key",
                "caf\u00e9",
                self.latin1(r.randint(0, 40)) + "\x7f" + self.latin1(r.randint(0, 40)),
                '"unterminated\\x"',
                '"a"b"',
                "\u2603" * r.randint(1, 10),
            ]
        )
        return bad, ""  # every one of these is invalid

    def body(self, uid: int | None) -> tuple[bytes, str, int | None]:
        r = self.rng
        roll = r.random()
        tag = f"u{uid}:{r.randrange(LABELS)}" if uid is not None else "anon"
        fields: dict[str, Any] = {"label": tag, "amount": r.randint(1, 50)}
        asked = None
        if r.random() < 0.06:
            asked = r.choice(STORED_STATUSES_ASKED + RELEASED_STATUSES_ASKED)
            fields["respond"] = asked
        elif r.random() < 0.04:
            fields["raise"] = r.choice(["validation", "parse", "not_found", "forbidden"])
        if roll < 0.45:
            return json.dumps(fields).encode(), "application/json", asked
        if roll < 0.60:
            shared = {"label": "shared", "amount": 1}  # the same bytes from every user
            return json.dumps(shared).encode(), "application/json", None
        if roll < 0.68:
            return urlencode(fields).encode(), "application/x-www-form-urlencoded", asked
        if roll < 0.73:
            return encode_multipart(BOUNDARY, fields), MULTIPART_CONTENT, asked
        if roll < 0.80:
            data = json.dumps(fields).encode()
            return data[: r.randrange(len(data))], "application/json", asked  # truncated JSON
        if roll < 0.85:
            return (
                bytes(r.randrange(256) for _ in range(r.randint(0, 200))),
                r.choice(["application/octet-stream", "application/json"]),
                None,
            )
        if roll < 0.90:
            n = r.randint(1, 300)
            return b'{"a":' * n + b"1" + b"}" * n, "application/json", None
        if roll < 0.97:
            return json.dumps(fields).encode(), r.choice(ODD_TYPES), asked
        if roll < 0.985:
            n = r.choice([2_000, 10_000, 100_000])
            return b"[" * n + b"]" * n, "application/json", None  # past the parser's depth
        if roll < 0.995:
            return b"", r.choice(("application/json", *ODD_TYPES)), None
        size = r.choice([CANONICAL_JSON_MAX_BYTES + 1, 1024 * 1024, 2_621_441, 4 * 1024 * 1024])
        return b'{"pad": "' + b"x" * size + b'"}', "application/json", None


@dataclass
class Outcome:
    status: int
    content: bytes
    headers: dict[str, str]
    error: str | None = None
    code: str | None = None  # the error code, whichever renderer ran

    @property
    def name(self) -> str:
        return self.error or str(self.status)


def send(client: APIClient, p: Planned, with_key: bool = True) -> Outcome:
    extra = dict(p.headers)
    if with_key and p.key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = p.key
    try:
        response = client.generic(p.method, p.path, p.body, content_type=p.content_type, **extra)
    except Exception as exc:  # a server would answer 500
        return Outcome(500, b"", {}, type(exc).__name__)
    content = b"".join(response.streaming_content) if response.streaming else response.content
    data = getattr(response, "data", None)
    if data is None:
        try:
            data = json.loads(content)
        except ValueError:
            data = None
    code = str(data["code"]) if isinstance(data, dict) and "code" in data else None
    headers = {k.lower(): v for k, v in response.items()}
    return Outcome(response.status_code, content, headers, code=code)


def labels_in(outcome: Outcome) -> set[str]:
    try:
        body = json.loads(outcome.content)
    except ValueError:
        return set()
    label = body.get("label") if isinstance(body, dict) else None
    return {label} if isinstance(label, str) else set()


class Checker:
    def __init__(self, clients: dict[int | None, APIClient]) -> None:
        self.clients = clients
        self.statuses: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []
        self.stored: dict[tuple[int, str], Outcome] = {}
        self.sent_400s: dict[tuple[int, str], set[bytes]] = defaultdict(set)

    def fail(self, p: Planned, got: Outcome, why: str) -> None:
        self.outcomes["FAILURE"] += 1
        if len(self.failures) < 20:
            self.failures.append(
                f"{why}: {p.method} {p.path} key={p.key!r} uid={p.uid} -> {got.name} {got.content[:200]!r}"
            )

    def check(self, p: Planned) -> None:
        client = self.clients[p.uid]
        got = send(client, p)
        self.statuses[got.name] += 1
        if got.status >= 500 and got.status != p.asked:
            baseline = send(client, p, with_key=False)
            if baseline.name == got.name and p.key is not None:
                self.outcomes["framework 5xx, same without a key"] += 1
            elif p.key is None:
                self.outcomes["framework 5xx, no key sent"] += 1
            else:
                self.fail(p, got, f"5xx the layer caused (without a key: {baseline.name})")
            return
        if got.status >= 500:
            self.outcomes["5xx the view was asked for"] += 1
            return
        code = got.code
        replayed = got.headers.get("idempotent-replayed") == "true"
        for label in labels_in(got):
            if label and label.encode() not in p.body and quote(label).encode() not in p.body:
                self.fail(p, got, "a response names a label this request did not send")
        if p.norm == "" and p.covered and p.uid is not None:
            if code != "idempotency_key_invalid" and got.status not in (404, 406):
                self.fail(p, got, "an invalid key was not refused")
        elif code == "idempotency_key_invalid" and p.norm:
            self.fail(p, got, "a valid key was refused")
        if code is not None and code.startswith(("idempotency_", "request_in")):
            self.outcomes[code] += 1
            return
        if p.uid is None or p.norm is None or p.norm == "" or not p.covered:
            if replayed:
                self.fail(p, got, "a replay without an accepted key")
            self.outcomes["ran without idempotency"] += 1
            return
        slot = (p.uid, p.norm)
        if replayed and "idempotency-expires" in got.headers:
            first = self.stored.get(slot)
            if first is None:
                self.fail(p, got, "a replay of nothing this user stored")
            elif (got.status, got.content) != (first.status, first.content) or any(
                got.headers.get(h) != first.headers.get(h)
                for h in ("content-type", "location", "idempotency-expires")
            ):
                self.fail(p, got, "a replay differs from the stored response")
            self.outcomes["replayed stored response"] += 1
        elif replayed:
            if got.content not in self.sent_400s[slot]:
                self.fail(p, got, "a cached 400 this user was never sent")
            self.outcomes["replayed cached 400"] += 1
        elif "idempotency-expires" in got.headers:
            if slot in self.stored:
                self.fail(p, got, "executed twice under one stored key")
            self.stored[slot] = got
            self.outcomes["executed and stored"] += 1
        else:
            if got.status == 400:
                self.sent_400s[slot].add(got.content)
            self.outcomes["executed, released or not stored"] += 1


def transient_entries() -> int | str:
    cache = caches["default"]
    if not hasattr(cache, "delete_pattern"):
        return sum("idempotency:transient:" in k for k in cache._cache)
    client = cache.client.get_client(write=True)
    return len(list(client.scan_iter(match=cache.make_key("idempotency:transient:*"))))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--seed", type=int, default=20_260_101)
    args = parser.parse_args()

    for name in ("django.request", "django.security"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    layer_warnings: Counter[str] = Counter()

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            layer_warnings[record.levelname] += 1

    logging.getLogger("idempotency_app").addHandler(Count(logging.WARNING))
    logging.getLogger("idempotency_app").propagate = False

    setup_test_environment()
    old = setup_databases(verbosity=0, interactive=False)
    try:
        users = [User.objects.create(username=f"fuzz{i}").pk for i in range(args.users)]
        clients: dict[int | None, APIClient] = {None: APIClient()}
        for pk in users:
            clients[pk] = APIClient()
            clients[pk].force_authenticate(User.objects.get(pk=pk))
        generator = Generator(args.seed, users)
        checker = Checker(clients)
        started = time.perf_counter()
        for i in range(1, args.requests + 1):
            checker.check(generator.plan())
            if i % 10_000 == 0:
                rate = i / (time.perf_counter() - started)
                print(
                    f"  {i:>7} requests, {rate:,.0f}/s, failures {checker.outcomes['FAILURE']}",
                    flush=True,
                )
        elapsed = time.perf_counter() - started
        rows = IdempotencyRecord.objects.count()
        claims_left = IdempotencyRecord.objects.filter(status="in_progress").count()
        entries = transient_entries()
        if claims_left:
            checker.failures.append(f"{claims_left} claims left in progress")
        if rows != len(checker.stored):
            checker.failures.append(f"{rows} rows for {len(checker.stored)} stored outcomes")
        if hasattr(caches["default"], "delete_pattern"):
            caches["default"].delete_pattern("*")  # this run's KEY_PREFIX only
    finally:
        teardown_databases(old, verbosity=0)
        teardown_test_environment()

    print(
        f"\nbackend {connection.vendor}, cache {caches['default'].__class__.__name__}, seed {args.seed}"
    )
    print(
        f"{args.requests:,} requests in {elapsed:.1f}s: {args.requests / elapsed:,.0f} requests/s"
    )
    print("status counts:", ", ".join(f"{k}: {v}" for k, v in sorted(checker.statuses.items())))
    print("outcomes:")
    for name, count in checker.outcomes.most_common():
        print(f"  {count:>7}  {name}")
    print(f"rows left: {rows} (one per stored outcome), in-progress claims: {claims_left}")
    print(f"transient cache entries left: {entries}")
    print(f"layer log records: {dict(layer_warnings) or 'none'}")
    if checker.failures:
        print("\nFAILURES:")
        print("\n".join(checker.failures))
        return 1
    print("no 5xx caused by the layer, no cross-scope replay")
    return 0


if __name__ == "__main__":
    sys.exit(main())
