"""What the layer stores, who it replays to, and what a hostile client can cost.

A few views live here rather than in the test app because they exist only to
emit headers and bodies no real view should; the marker below serves them
alongside the test app's own routes.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.cache import caches
from django.http import FileResponse, HttpResponse
from django.test.utils import override_settings
from django.urls import include, path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.test import APIClient

import idempotency_app
from idempotency_app import signals
from idempotency_app.decorators import idempotent
from idempotency_app.guard import guard
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity
from tests.conftest import claims, needs_redis, post
from tests.testapp.models import Charge, LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.http.test_security")]

INVALID = {"raise": "validation"}

# --- views that misbehave on purpose ------------------------------------------------

# Every header the issue says must never be stored; the value says which rule.
NEVER_STORED = {
    "Set-Cookie": "session=secret; HttpOnly",
    "Authorization": "Bearer leaked",
    "WWW-Authenticate": 'Basic realm="api"',
    "Proxy-Authenticate": 'Basic realm="proxy"',
    "Proxy-Authorization": "Basic cHJveHk6cHc=",
    "Proxy-Authentication-Info": "nextnonce=abc",
    "Proxy-Connection": "keep-alive",
    "Proxy-Status": "edge; error=timeout",
    "Connection": "close",
    "Keep-Alive": "timeout=5",
    "TE": "trailers",
    "Trailer": "Expires",
    "Transfer-Encoding": "chunked",
    "Upgrade": "websocket",
}


@api_view(["POST"])
@idempotent
def leaky_view(request: Request) -> HttpResponse:
    Charge.objects.create(label="leaky")
    response = HttpResponse(b'{"ok": true}', status=201, content_type="application/json")
    response.set_cookie("auth_token", "secret")
    for name, value in NEVER_STORED.items():
        response[name] = value
    response["X-Trace"] = "abc"
    response["Location"] = "/charges/1/"
    return response


@api_view(["POST"])
@idempotent
def sized_view(request: Request) -> HttpResponse:
    """A body of exactly ``size`` bytes, to probe MAX_BODY_BYTES at its edge."""
    charge = Charge.objects.create(label="sized")
    LedgerEntry.objects.create(charge=charge, amount=0)
    response = HttpResponse(b"x" * int(request.data["size"]), status=201, content_type="text/plain")
    response["Location"] = f"/charges/{charge.pk}/"
    return response


@api_view(["POST"])
@idempotent
def file_view(request: Request) -> FileResponse:
    Charge.objects.create(label="file")
    return FileResponse(io.BytesIO(b"%PDF-1.7 receipt"), filename="receipt.pdf", status=201)


urlpatterns = [
    path("leaky/", leaky_view),
    path("sized/", sized_view),
    path("file/", file_view),
    path("", include("tests.urls")),
]


def tenant_scope(request: Any) -> str | None:
    """An integrator's scope: the tenant named by a header (after the
    project's own authentication has vouched for it)."""
    tenant = request.headers.get("X-Tenant")
    return f"tenant:{tenant}" if tenant else None


TENANT_SCOPE = {"SCOPE": "tests.http.test_security.tenant_scope"}


def stored_header_names() -> set[str]:
    record = IdempotencyRecord.objects.get()
    return {name.lower() for name, _ in json.loads(record.response_headers)}


# --- what is stored -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(NEVER_STORED))
def test_forbidden_header_never_stored_even_when_named(api: APIClient, key: str, name: str) -> None:
    with override_settings(IDEMPOTENCY={"STORE_HEADERS": [name, name.lower(), "X-Trace"]}):
        first = post(api, "/leaky/", {}, key)
        replay = post(api, "/leaky/", {}, key)
    assert first[name] == NEVER_STORED[name], "the first response is the view's own"
    assert name.lower() not in stored_header_names()
    assert name not in replay
    assert replay["Idempotent-Replayed"] == "true"
    assert replay["X-Trace"] == "abc", "a named, harmless header is stored"


def test_default_allow_list_keeps_representation_headers_only(api: APIClient, key: str) -> None:
    post(api, "/leaky/", {}, key)
    replay = post(api, "/leaky/", {}, key)
    assert stored_header_names() == {"content-type", "location", "idempotency-expires"}
    assert "auth_token" not in replay.cookies
    assert "X-Trace" not in replay
    assert (replay["Content-Type"], replay["Location"]) == ("application/json", "/charges/1/")


def test_cookies_set_by_the_view_never_replay(api: APIClient, key: str) -> None:
    first = post(api, "/charges-cookie/", {"label": "a"}, key)
    with override_settings(
        IDEMPOTENCY={"STORE_HEADERS": ["Set-Cookie", "Cookie", "Authorization"]}
    ):
        replay = post(api, "/charges-cookie/", {"label": "a"}, key)
    assert first.cookies["session"].value == "secret"
    assert not replay.cookies
    assert "Authorization" not in replay
    record = IdempotencyRecord.objects.get()
    assert b"secret" not in record.response_headers.encode()
    assert b"leaked" not in record.response_headers.encode()


def test_request_body_and_credentials_are_not_stored(user: User, key: str) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Basic YWxpY2U6cHc=")  # alice:pw
    response = post(client, "/charges/", {"label": "a", "card": "4242424242424242"}, key)
    assert response.status_code == 201
    record = IdempotencyRecord.objects.get()
    row = json.dumps([str(getattr(record, f.attname)) for f in record._meta.fields]).encode()
    row += bytes(record.response_body)
    assert b"4242424242424242" not in row, "only a fingerprint of the request is kept"
    assert b"YWxpY2U6cHc=" not in row


def test_stored_response_is_plain_json_and_bytes(api: APIClient, key: str) -> None:
    first = post(api, "/charges/", {"label": "a"}, key)
    record = IdempotencyRecord.objects.get()
    assert record.format_version == 1
    headers = json.loads(record.response_headers)
    assert all(isinstance(pair, list) and len(pair) == 2 for pair in headers)
    assert bytes(record.response_body) == first.content


# --- no pickle --------------------------------------------------------------------------

DOTTED = re.compile(r"\w+(\.\w+)+")
UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "jsonpickle",
}


def _package_sources() -> Iterator[Path]:
    yield from Path(idempotency_app.__file__).parent.rglob("*.py")


def test_no_pickle_anywhere_in_the_package() -> None:
    """Imports and names, not comments: docstrings may say "never a pickle"."""
    found = []
    sources = list(_package_sources())
    assert len(sources) > 10
    for source in sources:
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and DOTTED.fullmatch(node.value)
            ):
                names = node.value.split(".")  # a dotted path such as a serializer setting
            for name in names:
                if name in UNSAFE_MODULES or "pickle" in name.lower():
                    found.append(f"{source.name}:{getattr(node, 'lineno', '?')} {name}")
    assert not found


@pytest.fixture
def guard_keys() -> Iterator[list[str]]:
    """Cache keys of every guard hit, taken from the public signal."""
    seen: list[str] = []

    def record(sender: Any, identity: Identity, **kwargs: Any) -> None:
        seen.append(guard.get_cache_key(identity))

    signals.guard_hit.connect(record, weak=False)
    yield seen
    signals.guard_hit.disconnect(record)


def _raw_guard_value(cache_key: str) -> bytes:
    """What the cache holds, read beneath any serializer the cache has."""
    cache = caches["default"]
    if hasattr(cache, "delete_pattern"):
        raw: bytes = cache.client.get_client(write=True).get(cache.make_key(cache_key))
        return raw
    return str(cache.get(cache_key)).encode()


def _assert_versioned_json(raw: bytes, first: Any) -> None:
    assert not raw.startswith(b"\x80"), "a pickle starts with its protocol byte"
    value = json.loads(raw)
    assert value["v"] == 1
    assert value["s"] == 400
    assert base64.b64decode(value["b"]) == first.content


@needs_redis
def test_raw_redis_value_is_versioned_json(api: APIClient, key: str, guard_keys: list[str]) -> None:
    first = post(api, "/charges/", INVALID, key)
    post(api, "/charges/", INVALID, key)
    assert len(guard_keys) == 1
    _assert_versioned_json(_raw_guard_value(guard_keys[0]), first)
    cache = caches["default"]
    assert 0 < cache.client.get_client(write=True).pttl(cache.make_key(guard_keys[0])) <= 10_000


def test_cached_value_is_versioned_json_on_any_cache(
    api: APIClient, key: str, guard_keys: list[str]
) -> None:
    first = post(api, "/charges/", INVALID, key)
    post(api, "/charges/", INVALID, key)
    assert len(guard_keys) == 1
    _assert_versioned_json(_raw_guard_value(guard_keys[0]), first)


# --- who a response is replayed to ---------------------------------------------------------


def test_anonymous_key_is_refused_and_nothing_is_claimed(db: Any, key: str) -> None:
    responses = [post(APIClient(), "/charges-anonymous/", {"label": "a"}, key) for _ in range(2)]
    for response in responses:
        assert response.status_code == 400
        assert response.json()["code"] == "idempotency_scope_missing"
        assert "Authenticate" in response.json()["detail"]
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0


def test_two_anonymous_clients_never_share_a_response(db: Any) -> None:
    first = post(APIClient(), "/charges-anonymous/", {"label": "a"}, None)
    second = post(APIClient(), "/charges-anonymous/", {"label": "a"}, None)
    assert (first.status_code, second.status_code) == (201, 201)
    assert first.json()["id"] != second.json()["id"]
    assert "Idempotent-Replayed" not in second


def test_anonymous_with_a_scope_that_ignores_the_user_is_still_isolated(db: Any, key: str) -> None:
    """An integrator may scope anonymous clients by a value of their own
    (here a tenant header); clients with different values never share."""
    with override_settings(IDEMPOTENCY=TENANT_SCOPE):
        mine = post(APIClient(), "/charges-anonymous/", {"label": "a"}, key, HTTP_X_TENANT="one")
        theirs = post(APIClient(), "/charges-anonymous/", {"label": "a"}, key, HTTP_X_TENANT="two")
        again = post(APIClient(), "/charges-anonymous/", {"label": "a"}, key, HTTP_X_TENANT="one")
    assert "Idempotent-Replayed" not in theirs
    assert theirs.json()["id"] != mine.json()["id"]
    assert again["Idempotent-Replayed"] == "true" and again.content == mine.content


def test_tenant_scope_isolates_tenants(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY=TENANT_SCOPE):
        acme = post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT="acme")
        globex = post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT="globex")
        acme_again = post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT="acme")
        no_tenant = post(api, "/charges/", {"label": "a"}, key)
    assert "Idempotent-Replayed" not in globex
    assert globex.json()["id"] != acme.json()["id"]
    assert acme_again["Idempotent-Replayed"] == "true" and acme_again.content == acme.content
    assert no_tenant.status_code == 400
    assert no_tenant.json()["code"] == "idempotency_scope_missing"
    assert sorted(IdempotencyRecord.objects.values_list("scope", flat=True)) == [
        "tenant:acme",
        "tenant:globex",
    ]


def test_a_scope_hook_patched_by_a_test_is_the_one_that_runs(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hook named by its path is looked up per request, not kept from the
    first one: a test that patches it sees its patch."""
    with override_settings(IDEMPOTENCY=TENANT_SCOPE):
        post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT="acme")
        monkeypatch.setattr("tests.http.test_security.tenant_scope", lambda request: "patched")
        post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT="acme")
    assert sorted(IdempotencyRecord.objects.values_list("scope", flat=True)) == [
        "patched",
        "tenant:acme",
    ]


@pytest.mark.parametrize(
    ("one", "two"),
    [
        pytest.param("acme", "ACME", id="case"),
        pytest.param("cafe", "caf\u00e9", id="accent"),
        pytest.param("acme", "acme ", id="trailing-space"),
        pytest.param("x" * 300, "x" * 300 + "y", id="long-hashed"),
        pytest.param("x" * 255, "x" * 254 + "y", id="longest-kept"),
    ],
)
def test_tenants_that_differ_slightly_are_isolated(
    api: APIClient, key: str, one: str, two: str
) -> None:
    with override_settings(IDEMPOTENCY=TENANT_SCOPE):
        first = post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT=one)
        second = post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT=two)
    assert first.status_code == 201
    assert second.status_code == 201, second.content
    assert "Idempotent-Replayed" not in second, "one tenant was served another's response"
    assert second.json()["id"] != first.json()["id"]


@pytest.mark.parametrize(
    ("one", "two"),
    [
        pytest.param("Order-7f3a", "ORDER-7F3A", id="case"),
        pytest.param("abc", '"abc "', id="quoted-trailing-space"),
    ],
)
def test_keys_that_differ_slightly_are_different_keys(api: APIClient, one: str, two: str) -> None:
    first = post(api, "/charges/", {"label": "a"}, one)
    second = post(api, "/charges/", {"label": "b"}, two)
    assert (first.status_code, second.status_code) == (201, 201), second.content
    assert IdempotencyRecord.objects.count() == 2


@pytest.mark.parametrize(
    "tenant",
    [
        pytest.param("a\x00b"),
        "tab\there",
        "\x7f",
        "caf\u00e9",
        "\u00ff" * 300,
    ],
)
def test_odd_tenant_values_never_fail_the_request(api: APIClient, key: str, tenant: str) -> None:
    with override_settings(IDEMPOTENCY=TENANT_SCOPE):
        first = post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT=tenant)
        again = post(api, "/charges/", {"label": "a"}, key, HTTP_X_TENANT=tenant)
    assert first.status_code == 201, first.content
    assert again["Idempotent-Replayed"] == "true"


# --- oversized and streaming responses ----------------------------------------------------


@pytest.mark.parametrize(("size", "kept"), [(100, True), (101, False)])
def test_max_body_bytes_edge(api: APIClient, key: str, size: int, kept: bool) -> None:
    with override_settings(IDEMPOTENCY={"MAX_BODY_BYTES": 100}):
        first = post(api, "/sized/", {"size": size}, key)
        replay = post(api, "/sized/", {"size": size}, key)
    assert first.content == b"x" * size, "the first client always gets the whole body"
    record = IdempotencyRecord.objects.get()
    assert record.status == "completed"
    assert (record.response_body is not None) is kept
    assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
    assert replay["Location"] == first["Location"]
    if kept:
        assert replay.content == first.content
        assert "Idempotent-Body-Omitted" not in replay
    else:
        assert replay.content == b""
        assert replay["Idempotent-Body-Omitted"] == "true"
        assert "Content-Type" not in replay, "no body, so no type for it"
    assert Charge.objects.count() == LedgerEntry.objects.count() == 1, "never a second execution"


def test_oversized_validation_error_is_guarded_without_its_body(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY={"MAX_BODY_BYTES": 5}):
        first = post(api, "/charges/", INVALID, key)
        second = post(api, "/charges/", INVALID, key)
    assert first.status_code == second.status_code == 400
    assert len(first.content) > 5
    assert second["Idempotent-Replayed"] == "true"
    assert second["Idempotent-Body-Omitted"] == "true"
    assert second.content == b""


@pytest.mark.parametrize(
    ("url", "body"), [("/charges-stream/", b"chunkchunkchunk"), ("/file/", b"%PDF-1.7 receipt")]
)
def test_streaming_response_completes_without_body(
    api: APIClient, key: str, url: str, body: bytes
) -> None:
    first = post(api, url, {}, key)
    assert b"".join(first.streaming_content) == body
    record = IdempotencyRecord.objects.get()
    assert (record.status, record.response_status, record.response_body) == ("completed", 201, None)
    for _ in range(3):
        replay = post(api, url, {}, key)
        assert replay.status_code == 201
        assert replay["Idempotent-Replayed"] == "true"
        assert replay["Idempotent-Body-Omitted"] == "true"
        assert replay.content == b""
    assert Charge.objects.count() == 1, "never a second execution"


# --- what a client minting fresh keys can cost ------------------------------------------------


def _transient_entries() -> int:
    cache = caches["default"]
    if hasattr(cache, "delete_pattern"):
        client = cache.client.get_client(write=True)
        return len(list(client.scan_iter(match=cache.make_key("idempotency:transient:*"))))
    return sum("idempotency:transient:" in k for k in cache._cache)


def test_one_row_per_fresh_key_and_none_per_retry(api: APIClient) -> None:
    for i in range(20):
        post(api, "/charges/", {"label": str(i)}, f"fresh-{i}")
    assert IdempotencyRecord.objects.count() == 20
    for i in range(20):
        post(api, "/charges/", {"label": str(i)}, f"fresh-{i}")
        post(api, "/charges/", {"label": "changed"}, f"fresh-{i}")  # 422, stores nothing
    assert IdempotencyRecord.objects.count() == 20


@pytest.mark.parametrize("body", [{"respond": 500}, {"respond": 409}, {"respond": 429}])
def test_released_outcomes_leave_no_row(api: APIClient, body: dict[str, Any]) -> None:
    for i in range(10):
        post(api, "/charges/", body, f"fresh-{i}")
    assert not IdempotencyRecord.objects.exists()


def test_a_validation_error_leaves_a_marker_without_its_response(api: APIClient) -> None:
    """A marker per key for TRANSIENT_ERROR_TTL, holding no response (that
    is in the guard's cache), swept like an expired record."""
    for i in range(10):
        post(api, "/charges/", INVALID, f"fresh-{i}")
    markers = IdempotencyRecord.objects.all()
    assert markers.count() == 10
    assert {(r.status, r.response_body, r.response_status) for r in markers} == {
        ("released", None, None)
    }


def test_one_cache_entry_per_scope_key_and_fingerprint(
    api: APIClient, other_user: User, key: str
) -> None:
    for _ in range(5):
        post(api, "/charges/", INVALID, key)
    assert _transient_entries() == 1, "retries of one bad request share an entry"
    post(api, "/charges/", {**INVALID, "label": "other"}, key)
    post(api, "/charges/", INVALID, "another-key")
    other = APIClient()
    other.force_authenticate(other_user)
    post(other, "/charges/", INVALID, key)
    assert _transient_entries() == 4
    assert not claims().exists()


def test_guard_can_be_switched_off(api: APIClient) -> None:
    with override_settings(IDEMPOTENCY={"TRANSIENT_ERROR_TTL": 0}):
        for i in range(5):
            post(api, "/charges/", INVALID, f"fresh-{i}")
    assert _transient_entries() == 0


def test_throttling_caps_rows_before_any_claim(api: APIClient) -> None:
    """DRF throttles run before the layer: a throttled request costs no row."""
    codes = [
        post(api, "/charges-throttled/", {"label": "a"}, f"fresh-{i}").status_code
        for i in range(10)
    ]
    assert codes.count(429) == 7
    assert IdempotencyRecord.objects.count() == 3


# --- hostile headers ------------------------------------------------------------------------

BODY = b'{"label": "a"}'


def _send(client: APIClient, key: str | None, content_type: str, **extra: Any) -> Any:
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    return client.generic("POST", "/charges/", BODY, content_type=content_type, **extra)


@pytest.mark.parametrize("length", ["13abc", " ", "-1", "+13", "1_3", "0x0e", "\u0661", "9" * 5000])
def test_a_content_length_that_is_not_a_number_is_a_400_before_any_claim(
    quiet_api: APIClient, key: str, length: str
) -> None:
    """Django reads such a header as 0 (the view sees no body); with a key,
    reading it failed with a 500. Now it is refused, nothing claimed."""
    refused = _send(quiet_api, key, "application/json", CONTENT_LENGTH=length)
    assert refused.status_code == 400, refused.content
    assert "Content-Length" in refused.json()["detail"]
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()
    without_key = _send(quiet_api, None, "application/json", CONTENT_LENGTH=length)
    assert without_key.status_code < 500


ODD_CONTENT_TYPES = [
    "application/json",
    "application/json; charset=rot13",
    "application/json; charset=hex",
    "application/json; charset=nope",
    "application/json; charset=idna",
    "application/json; charset=punycode",
    "application/json; charset=unicode_escape",
    "application/json; charset=undefined",
    "application/json; charset=utf-16",
    'application/json; charset="',
    "application/json; charset=" + "a" * 3000,
    "application/json;;charset=utf-8",
    "application/\xff+json",
    "multipart/form-data",
    "multipart/form-data; boundary=",
    "text/plain; charset=zlib",
    "\x00",
    ";;;",
]
ODD_ACCEPTS = [
    None,
    "*/*;q=nan",
    "application/json;q=abc",
    "text/html;q=1e999",
    "application/json, \x00",
    "*/*; x=\x00",
    "," * 1000,
    "\xff\xfe, */*",
    "application/json, " + "a/b;" * 2000,
]


@pytest.mark.parametrize("content_type", ODD_CONTENT_TYPES)
def test_odd_content_types_and_accepts_never_fail_on_the_idempotent_path(
    quiet_api: APIClient, content_type: str
) -> None:
    """Whatever the layer makes of them, a key never turns an odd header
    into a 5xx the same request without a key does not get."""
    for i, accept in enumerate(ODD_ACCEPTS):
        extra = {} if accept is None else {"HTTP_ACCEPT": accept}
        with_key = _send(quiet_api, f"odd-{i}", content_type, **extra)
        if with_key.status_code >= 500:
            without_key = _send(quiet_api, None, content_type, **extra)
            assert without_key.status_code >= 500, (accept, with_key.content)
        if with_key.status_code == 201:
            again = _send(quiet_api, f"odd-{i}", content_type, **extra)
            assert again["Idempotent-Replayed"] == "true", accept


def test_the_request_accept_is_not_stored(api: APIClient, key: str) -> None:
    """Only a digest of it, the size of a hash whatever the client sent."""
    accept = "application/json, " + ", ".join(f"application/x-secret-{i}" for i in range(300))
    first = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT=accept)
    assert first.status_code == 201
    record = IdempotencyRecord.objects.get()
    assert "x-secret" not in record.response_headers
    assert len(record.response_headers) < 300 < len(accept)
    assert stored_header_names() == {
        "content-type",
        "location",
        "idempotency-expires",
        "idempotency-request-accept-sha256",
    }
