"""What a replay carries: the first response's body with that response's
representation (its language), to the question it answered (its Accept),
and what the retry-storm guard's replay may refuse without letting the
view run again."""

from __future__ import annotations

import hashlib
import json

import hypothesis
import pytest
from django.conf import settings
from django.http import HttpResponse
from django.test import RequestFactory
from django.test.utils import override_settings
from django.urls import include, path
from django.utils import translation
from hypothesis import strategies as st
from rest_framework.decorators import api_view
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

from idempotency_app.decorators import idempotent
from idempotency_app.guard import guard
from idempotency_app.http.replay import (
    BODY_OMITTED_HEADER,
    REPLAYED_HEADER,
    replay,
)
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity, StoredResponse
from tests.conftest import claims, post
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.http.test_replay")]

INVALID = {"raise": "validation"}
JSON, HTML = "application/json", "text/html"
# Where rows keep the request's Accept: stable names, since stored rows hold them.
REQUEST_ACCEPT_DIGEST = "Idempotency-Request-Accept-SHA256"
REQUEST_ACCEPT = "Idempotency-Request-Accept"  # the Accept itself, in older rows


@api_view(["POST"])
@idempotent
def greeting(request: Request) -> HttpResponse:
    """A body in the language the request was answered in; or, asked for
    ``plain``, text whatever the client accepts."""
    if request.data.get("plain"):
        Charge.objects.create(label="plain")
        return HttpResponse(b"plain", status=request.data["plain"], content_type="text/plain")
    if request.data.get("invalid"):
        raise ValidationError({"amount": [f"invalid ({translation.get_language()})"]})
    charge = Charge.objects.create(label=translation.get_language() or "")
    response = Response({"id": charge.pk, "language": charge.label}, status=201)
    if request.data.get("language"):
        response["Content-Language"] = request.data["language"]
    return response


urlpatterns = [path("greeting/", greeting), path("", include("tests.urls"))]

WITH_LOCALE = [
    *settings.MIDDLEWARE[:1],
    "django.middleware.locale.LocaleMiddleware",
    *settings.MIDDLEWARE[1:],
]


def stored_headers() -> dict[str, str]:
    return dict(json.loads(IdempotencyRecord.objects.get().response_headers))


# -- the retry-storm guard against alternating Accept ----------------------------------


@pytest.mark.parametrize(("first", "other"), [(JSON, HTML), (HTML, JSON)])
def test_alternating_accept_never_lets_a_storm_run_the_view_again(
    api: APIClient, key: str, executions: list[int], first: str, other: str
) -> None:
    """The cached 400 is in ``first``'s type; a retry asking only for
    ``other`` gets 406, and keeps the window like a served 400 does."""
    codes = [
        post(api, "/charges/", INVALID, key, HTTP_ACCEPT=first if i % 2 == 0 else other).status_code
        for i in range(7)
    ]
    assert executions == [400], "the view ran once in the whole storm"
    assert codes == [400, 406, 400, 406, 400, 406, 400]
    assert not claims().exists()
    assert IdempotencyRecord.objects.get().status == "released", "the marker stays"


def test_the_guards_406_says_what_to_accept(api: APIClient, key: str) -> None:
    post(api, "/charges/", INVALID, key, HTTP_ACCEPT=JSON)
    refused = post(api, "/charges/", INVALID, key, HTTP_ACCEPT=HTML)
    assert refused.status_code == 406
    assert b"idempotency_replay_not_acceptable" in refused.content
    assert b"application/json" in refused.content
    with override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"}):
        problem = post(api, "/charges/", INVALID, key, HTTP_ACCEPT=HTML)
    assert problem.status_code == 406
    assert problem["Content-Type"] == "application/problem+json"
    assert problem.json()["code"] == "idempotency_replay_not_acceptable"


def test_a_corrected_request_still_runs_after_a_refused_replay(
    api: APIClient, key: str, executions: list[int]
) -> None:
    post(api, "/charges/", INVALID, key, HTTP_ACCEPT=JSON)
    post(api, "/charges/", INVALID, key, HTTP_ACCEPT=HTML)
    fixed = post(api, "/charges/", {"label": "fixed"}, key, HTTP_ACCEPT=HTML)
    assert fixed.status_code == 201 and "Idempotent-Replayed" not in fixed
    assert executions == [400, 201]


# -- Content-Language ------------------------------------------------------------------


def test_a_replay_names_the_language_of_its_body(api: APIClient, key: str) -> None:
    """LocaleMiddleware labels a response after the view: without the
    language stored, a French body would be replayed as German."""
    with override_settings(MIDDLEWARE=WITH_LOCALE):
        french = post(api, "/greeting/", {}, key, HTTP_ACCEPT_LANGUAGE="fr")
        retry = post(api, "/greeting/", {}, key, HTTP_ACCEPT_LANGUAGE="de")
    assert french["Content-Language"] == "fr" and french.json()["language"] == "fr"
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == french.content
    assert retry["Content-Language"] == "fr", "the body's language, not the retry's"
    assert stored_headers()["Content-Language"] == "fr"


def test_the_guards_replay_names_the_language_of_its_body(api: APIClient, key: str) -> None:
    with override_settings(MIDDLEWARE=WITH_LOCALE):
        french = post(api, "/greeting/", {"invalid": 1}, key, HTTP_ACCEPT_LANGUAGE="fr")
        retry = post(api, "/greeting/", {"invalid": 1}, key, HTTP_ACCEPT_LANGUAGE="de")
    assert french.status_code == retry.status_code == 400
    assert b"(fr)" in french.content
    assert retry["Idempotent-Replayed"] == "true" and retry.content == french.content
    assert retry["Content-Language"] == "fr"


def test_a_language_the_view_set_is_the_one_replayed(api: APIClient, key: str) -> None:
    with override_settings(MIDDLEWARE=WITH_LOCALE):
        first = post(api, "/greeting/", {"language": "nl"}, key, HTTP_ACCEPT_LANGUAGE="fr")
        retry = post(api, "/greeting/", {"language": "nl"}, key, HTTP_ACCEPT_LANGUAGE="de")
    assert first["Content-Language"] == retry["Content-Language"] == "nl"
    assert stored_headers()["Content-Language"] == "nl"


def test_no_language_is_added_without_the_middleware(api: APIClient, key: str) -> None:
    """A response that had no Content-Language replays without one."""
    with translation.override("fr"):
        first = post(api, "/greeting/", {}, key, HTTP_ACCEPT_LANGUAGE="fr")
        retry = post(api, "/greeting/", {}, key, HTTP_ACCEPT_LANGUAGE="de")
    assert "Content-Language" not in first
    assert retry["Idempotent-Replayed"] == "true" and "Content-Language" not in retry
    assert "Content-Language" not in stored_headers()


# -- the Accept a stored response answered ---------------------------------------------

LONG_ACCEPT = ", ".join(
    [JSON, *(f"application/vnd.example.v{i}+json;q=0.{i % 9 + 1}" for i in range(200))]
)


def test_only_a_digest_of_the_accept_is_stored(api: APIClient, key: str) -> None:
    assert len(LONG_ACCEPT) > 7000
    first = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT=LONG_ACCEPT)
    retry = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT=LONG_ACCEPT)
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
    record = IdempotencyRecord.objects.get()
    assert "vnd.example" not in record.response_headers
    assert len(record.response_headers) < 300
    digest = hashlib.sha256(LONG_ACCEPT.encode()).hexdigest()
    assert stored_headers()[REQUEST_ACCEPT_DIGEST] == digest
    assert REQUEST_ACCEPT_DIGEST not in retry and REQUEST_ACCEPT not in retry


@pytest.mark.parametrize(
    ("first", "retry", "status"),
    [
        (JSON, JSON, 201),
        (JSON, "text/html", 406),
        (None, None, 201),
        (None, "text/html", 406),
        (JSON, None, 201),
        (LONG_ACCEPT, LONG_ACCEPT, 201),
        (LONG_ACCEPT, LONG_ACCEPT + " ", 201),  # another question, still taking JSON
        (LONG_ACCEPT, "image/png", 406),
    ],
)
def test_each_accept_answered_alike_while_its_digest_is_kept(
    api: APIClient, key: str, first: str | None, retry: str | None, status: int
) -> None:
    """Twice over, so that the second round finds the digests kept (those
    of an Accept of ordinary length)."""
    sent = {} if first is None else {"HTTP_ACCEPT": first}
    again = {} if retry is None else {"HTTP_ACCEPT": retry}
    for round_key in (key, key + "-again"):
        stored = post(api, "/charges/", {"label": "a"}, round_key, **sent)
        answer = post(api, "/charges/", {"label": "a"}, round_key, **again)
        assert (stored.status_code, answer.status_code) == (201, status)
        if status == 201:
            assert answer.content == stored.content
    assert Charge.objects.count() == 2


def test_only_the_digest_of_an_accept_of_ordinary_length_is_kept() -> None:
    from idempotency_app.http import replay as replaying

    for accept in (JSON, LONG_ACCEPT):
        assert replaying.digest(accept) == hashlib.sha256(accept.encode()).hexdigest()
    kept = replaying._kept_digest.cache_info().currsize
    replaying.digest(LONG_ACCEPT + ", text/plain")
    assert replaying._kept_digest.cache_info().currsize == kept
    assert len(LONG_ACCEPT) > replaying.MAX_KEPT_ACCEPT


def test_the_guard_caches_only_the_digest_too(api: APIClient, key: str) -> None:
    post(api, "/charges/", INVALID, key, HTTP_ACCEPT=LONG_ACCEPT)
    cached = guard.get(_identity())
    assert cached is not None
    assert dict(cached.headers)[REQUEST_ACCEPT_DIGEST] == (
        hashlib.sha256(LONG_ACCEPT.encode()).hexdigest()
    )
    assert "vnd.example" not in json.dumps(cached.headers)
    retry = post(api, "/charges/", INVALID, key, HTTP_ACCEPT=LONG_ACCEPT)
    assert retry["Idempotent-Replayed"] == "true"


def _as_stored_by_older_versions(accept: str) -> None:
    """Put the Accept itself where the digest is, as rows stored before it hold it."""
    record = IdempotencyRecord.objects.get()
    headers = [
        [REQUEST_ACCEPT, accept] if name == REQUEST_ACCEPT_DIGEST else [name, value]
        for name, value in json.loads(record.response_headers)
    ]
    record.response_headers = json.dumps(headers)
    record.save(update_fields=["response_headers"])


def _identity() -> Identity:
    record = IdempotencyRecord.objects.get()
    return Identity(record.scope, record.key, record.operation, record.fingerprint)


@pytest.mark.parametrize("older", [False, True], ids=["digest", "stored-accept"])
def test_the_same_question_gets_the_same_answer(
    api: APIClient, key: str, executions: list[int], older: bool
) -> None:
    """The view answers text/plain whatever the client asks: the client
    that asked, asking again, gets it; another Accept that excludes it gets
    406. Rows stored before the digest (the Accept itself) still replay so."""
    first = post(api, "/greeting/", {"plain": 201}, key, HTTP_ACCEPT=JSON)
    assert first.status_code == 201 and first["Content-Type"] == "text/plain"
    if older:
        _as_stored_by_older_versions(JSON)
    again = post(api, "/greeting/", {"plain": 201}, key, HTTP_ACCEPT=JSON)
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert REQUEST_ACCEPT not in again and REQUEST_ACCEPT_DIGEST not in again
    other = post(api, "/greeting/", {"plain": 201}, key, HTTP_ACCEPT=f"application/xml, {JSON}")
    assert other.status_code == 406
    unasked = post(api, "/greeting/", {"plain": 201}, key)
    assert unasked.status_code == 201, "no Accept takes anything"
    assert executions == [201]


@pytest.mark.parametrize("older", [False, True], ids=["digest", "stored-accept"])
def test_the_guard_gives_the_same_question_the_same_answer(
    api: APIClient, key: str, executions: list[int], older: bool
) -> None:
    """The same for a guarded 400, and for entries cached before the digest."""
    first = post(api, "/greeting/", {"plain": 400}, key, HTTP_ACCEPT=JSON)
    assert first.status_code == 400 and first["Content-Type"] == "text/plain"
    cached = guard.get(_identity())
    assert cached is not None
    if older:
        headers = tuple(
            (REQUEST_ACCEPT, JSON) if name == REQUEST_ACCEPT_DIGEST else (name, value)
            for name, value in cached.headers
        )
        guard.set(_identity(), StoredResponse(cached.status, headers, cached.body))
    again = post(api, "/greeting/", {"plain": 400}, key, HTTP_ACCEPT=JSON)
    assert again.status_code == 400 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert REQUEST_ACCEPT not in again and REQUEST_ACCEPT_DIGEST not in again
    other = post(api, "/greeting/", {"plain": 400}, key, HTTP_ACCEPT=f"application/xml, {JSON}")
    assert other.status_code == 406
    assert executions == [400]


def set_one_by_one(stored: StoredResponse) -> HttpResponse:
    """What a replay must be: no default Content-Type, each stored header set
    in turn as Django sets headers (a name repeated in another case: the
    last stands), then the replay's own headers."""
    response = HttpResponse(stored.body or b"", status=stored.status)
    del response["Content-Type"]
    for name, value in stored.headers:
        if name not in {REQUEST_ACCEPT_DIGEST, REQUEST_ACCEPT}:
            response[name] = value
    if stored.body is None:
        response[BODY_OMITTED_HEADER] = "true"
        if "Content-Type" in response:
            del response["Content-Type"]
    response[REPLAYED_HEADER] = "true"
    return response


HEADER_NAMES = [
    *("Content-Type", "content-type", "Location", "X-A", "x-a", "Content-Language"),
    *("Idempotent-Replayed", "idempotent-replayed", "Idempotent-Body-Omitted"),
    *(REQUEST_ACCEPT_DIGEST, REQUEST_ACCEPT.lower(), "Idempotency-Expires"),
]


@hypothesis.settings(max_examples=500, deadline=None)
@hypothesis.given(
    status=st.sampled_from([200, 201, 204, 302, 404, 422]),
    headers=st.lists(
        st.tuples(st.sampled_from(HEADER_NAMES), st.sampled_from(["", "a/b", "x", "true"])),
        max_size=5,
    ),
    body=st.sampled_from([None, b"", b"{}", b"\xff\x00bytes"]),
)
def test_a_replay_sets_the_stored_headers_in_turn(
    status: int, headers: list[tuple[str, str]], body: bytes | None
) -> None:
    """Names repeated in another case, no Content-Type or an empty one, a
    body not kept, the replay's own header names among the stored ones."""
    stored = StoredResponse(status, tuple(headers), body)
    raw = RequestFactory().post("/charges/", b"{}", content_type="application/json")
    view = APIView()
    view.format_kwarg = None
    replayed = replay(stored, Request(raw), view)
    expected = set_one_by_one(stored)
    assert (replayed.status_code, replayed.content, list(replayed.items())) == (
        expected.status_code,
        expected.content,
        list(expected.items()),
    )
    assert replayed[REPLAYED_HEADER] == "true"
