"""The lifecycle through @idempotent: every row of the SPEC's table."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings
from django.utils.http import http_date
from rest_framework.test import APIClient

from idempotency_app import clock
from idempotency_app.models import IdempotencyRecord
from tests.conftest import claims, post
from tests.testapp.models import Charge, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)


def test_first_request_runs_and_is_stored(api: APIClient, key: str) -> None:
    response = post(api, "/charges/", {"label": "a", "amount": 5}, key)
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    record = IdempotencyRecord.objects.get()
    assert (record.key, record.status, record.response_status) == (key, "completed", 201)
    assert record.scope.startswith("user:")
    assert record.operation == "POST charges/"
    assert bytes(record.response_body) == response.content
    assert Charge.objects.count() == 1


def test_retry_replays_byte_identical_without_running(api: APIClient, key: str) -> None:
    first = post(api, "/charges/", {"label": "a", "amount": 5}, key)
    second = post(api, "/charges/", {"label": "a", "amount": 5}, key)
    assert second.status_code == 201
    assert second.content == first.content
    assert second["Idempotent-Replayed"] == "true"
    assert second["Location"] == first["Location"]
    assert second["Content-Type"] == first["Content-Type"]
    assert Charge.objects.count() == 1


def test_stored_responses_advertise_their_replay_window(api: APIClient, key: str) -> None:
    from django.utils.http import parse_http_date

    with clock.freeze():
        first = post(api, "/charges/", {"label": "a"}, key)
        replay = post(api, "/charges/", {"label": "a"}, key)
        expected = clock.now() + timedelta(days=1)
    assert first["Idempotency-Expires"] == replay["Idempotency-Expires"]
    assert abs(parse_http_date(first["Idempotency-Expires"]) - expected.timestamp()) < 1
    released = post(api, "/charges/", {"label": "a", "respond": 503}, key + "x")
    assert "Idempotency-Expires" not in released


@pytest.mark.parametrize(
    "now",
    [
        datetime(2026, 11, 26, 12, 0, 0, 999999, tzinfo=timezone.utc),
        datetime(1969, 6, 1, 0, 0, 0, 500000, tzinfo=timezone.utc),  # before the epoch
    ],
)
def test_the_window_is_written_as_http_date_writes_it(
    api: APIClient, key: str, now: datetime
) -> None:
    """The date is formatted once per whole second: that second is the one
    ``http_date`` writes, fractions and clocks before 1970 included."""
    with clock.freeze(now):
        response = post(api, "/charges/", {"label": "a"}, key)
        expected = http_date((clock.now() + timedelta(days=1)).timestamp())
    assert response["Idempotency-Expires"] == expected


def test_json_key_order_is_not_a_different_request(api: APIClient, key: str) -> None:
    api.post(
        "/charges/",
        '{"label": "a", "amount": 5}',
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    again = api.post(
        "/charges/",
        '{"amount":5,"label":"a"}',
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_no_header_runs_without_idempotency(api: APIClient) -> None:
    post(api, "/charges/", {"label": "a"}, None)
    post(api, "/charges/", {"label": "a"}, None)
    assert Charge.objects.count() == 2
    assert not IdempotencyRecord.objects.exists()


def test_required_key_missing_is_400(api: APIClient) -> None:
    response = post(api, "/charges-required/", {"label": "a"}, None)
    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert "Idempotency-Key" in response.json()["detail"]
    assert Charge.objects.count() == 0


@pytest.mark.parametrize(
    "raw",
    ["", "   ", "k" * 256, "bad\x01key", "tab\tkey", "caf\u00e9", '"unterminated\\x"', '"a"b"'],
    ids=["empty", "blank", "256-chars", "control", "tab", "non-ascii", "bad-escape", "inner-quote"],
)
def test_invalid_keys_are_400(api: APIClient, raw: str) -> None:
    response = post(api, "/charges/", {"label": "a"}, raw)
    assert response.status_code == 400, raw
    assert response.json()["code"] == "idempotency_key_invalid"
    assert Charge.objects.count() == 0
    assert not IdempotencyRecord.objects.exists()


def test_255_characters_is_accepted(api: APIClient) -> None:
    assert post(api, "/charges/", {"label": "a"}, "k" * 255).status_code == 201


def test_quoted_sf_string_is_unquoted(api: APIClient) -> None:
    post(api, "/charges/", {"label": "a"}, '"abc"')
    replay = post(api, "/charges/", {"label": "a"}, "abc")
    assert replay["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().key == "abc"


def test_keys_are_case_sensitive_on_every_backend(api: APIClient) -> None:
    post(api, "/charges/", {"label": "a"}, "Key-AbC")
    other = post(api, "/charges/", {"label": "b"}, "key-aBc")
    assert other.status_code == 201 and "Idempotent-Replayed" not in other
    assert IdempotencyRecord.objects.count() == 2


def test_same_key_other_body_is_422(api: APIClient, key: str) -> None:
    post(api, "/charges/", {"label": "a", "amount": 5}, key)
    response = post(api, "/charges/", {"label": "a", "amount": 6}, key)
    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1


def test_same_key_other_route_is_422(api: APIClient, key: str) -> None:
    post(api, "/charges/", {"label": "a"}, key)
    response = post(api, "/mixin-charges/", {"label": "a"}, key)
    assert response.status_code == 422


def test_same_key_other_url_argument_is_422(api: APIClient, key: str) -> None:
    first = post(api, "/accounts/1/charges/", {"label": "a"}, key)
    assert first.json()["account"] == 1
    response = post(api, "/accounts/2/charges/", {"label": "a"}, key)
    assert response.status_code == 422
    assert Charge.objects.count() == 1


def test_keys_are_scoped_per_user(api: APIClient, other_user: Any, key: str) -> None:
    mine = post(api, "/charges/", {"label": "a"}, key)
    other = APIClient()
    other.force_authenticate(other_user)
    theirs = post(other, "/charges/", {"label": "a"}, key)
    assert theirs.status_code == 201
    assert "Idempotent-Replayed" not in theirs
    assert theirs.json()["id"] != mine.json()["id"]
    assert IdempotencyRecord.objects.count() == 2


def test_anonymous_key_is_refused(db: Any, key: str) -> None:
    response = post(APIClient(), "/charges-anonymous/", {"label": "a"}, key)
    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_scope_missing"
    assert Charge.objects.count() == 0
    # Without a key the anonymous endpoint works as before.
    assert post(APIClient(), "/charges-anonymous/", {"label": "a"}, None).status_code == 201


def test_authentication_runs_first(db: Any, key: str) -> None:
    response = post(APIClient(), "/charges/", {"label": "a"}, key)
    assert response.status_code in (401, 403)
    assert not IdempotencyRecord.objects.exists()


def test_throttling_runs_first(api: APIClient) -> None:
    codes = [
        post(api, "/charges-throttled/", {"label": "a"}, f"k{i}").status_code for i in range(4)
    ]
    assert codes == [201, 201, 201, 429]
    assert IdempotencyRecord.objects.count() == 3


def test_in_progress_is_409_with_retry_after(api: APIClient, key: str, user: Any) -> None:
    _hold_claim(user, key, "POST charges/", api)
    response = post(api, "/charges/", {"label": "a"}, key)
    assert response.status_code == 409
    assert response.json()["code"] == "request_in_progress"
    assert int(response["Retry-After"]) >= 1
    assert Charge.objects.count() == 0


def test_in_progress_with_other_body_is_422(api: APIClient, key: str, user: Any) -> None:
    _hold_claim(user, key, "POST charges/", api, fingerprint="0" * 64)
    assert post(api, "/charges/", {"label": "a"}, key).status_code == 422


def test_lapsed_claim_is_taken_over(api: APIClient, key: str, user: Any) -> None:
    _hold_claim(user, key, "POST charges/", api, locked_until=clock.now() - timedelta(seconds=1))
    response = post(api, "/charges/", {"label": "a"}, key)
    assert response.status_code == 201
    record = IdempotencyRecord.objects.get()
    assert record.token != "stale-token" and record.status == "completed"
    assert Charge.objects.count() == 1


def test_lapsed_claim_with_other_body_is_422(api: APIClient, key: str, user: Any) -> None:
    _hold_claim(
        user,
        key,
        "POST charges/",
        api,
        fingerprint="0" * 64,
        locked_until=clock.now() - timedelta(seconds=1),
    )
    assert post(api, "/charges/", {"label": "a"}, key).status_code == 422
    assert IdempotencyRecord.objects.get().token == "stale-token"


def test_claim_past_its_ttl_with_a_live_lease_is_still_in_progress(
    api: APIClient, key: str, user: Any
) -> None:
    record = _hold_claim(user, key, "POST charges/", api)
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        expires_at=clock.now() - timedelta(seconds=1)
    )
    assert post(api, "/charges/", {"label": "a"}, key).status_code == 409
    assert IdempotencyRecord.objects.get().token == "stale-token"


@pytest.mark.parametrize("body", [{"label": "a"}, {"label": "other"}], ids=["same", "different"])
def test_expired_record_is_claimed_anew(api: APIClient, key: str, body: dict[str, str]) -> None:
    with clock.freeze():
        post(api, "/charges/", {"label": "a"}, key)
        clock.advance(24 * 3600 + 1)
        response = post(api, "/charges/", body, key)
    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 1


def test_ttl_override_on_the_view_settings(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY={"TTL": 120}), clock.freeze():
        post(api, "/charges/", {"label": "a"}, key)
        clock.advance(121)
        assert "Idempotent-Replayed" not in post(api, "/charges/", {"label": "a"}, key)


@pytest.mark.parametrize("code", [200, 201, 202, 204, 301, 401, 402, 403, 404, 410, 412, 422])
def test_success_and_deterministic_4xx_are_stored(api: APIClient, key: str, code: int) -> None:
    first = post(api, "/charges/", {"label": "a", "respond": code}, key)
    second = post(api, "/charges/", {"label": "a", "respond": code}, key)
    assert (first.status_code, second.status_code) == (code, code)
    assert second["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert Charge.objects.count() == 1
    assert LedgerEntry.objects.count() == 1


@pytest.mark.parametrize("code", [500, 502, 503, 408, 409, 425, 429])
def test_retryable_statuses_release_and_roll_back(api: APIClient, key: str, code: int) -> None:
    first = post(api, "/charges/", {"label": "a", "respond": code}, key)
    assert first.status_code == code
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0, "a released outcome rolls the view's work back"
    again = post(api, "/charges/", {"label": "a"}, key)
    assert again.status_code == 201 and "Idempotent-Replayed" not in again


def test_exception_releases_and_rolls_back(key: str, user: Any) -> None:
    client = APIClient(raise_request_exception=False)
    client.force_authenticate(user)
    response = post(client, "/charges/", {"label": "a", "raise": "crash"}, key)
    assert response.status_code == 500
    assert not IdempotencyRecord.objects.exists()
    assert post(client, "/charges/", {"label": "a"}, key).status_code == 201


@pytest.mark.parametrize(("exc", "code"), [("not_found", 404), ("forbidden", 403)])
def test_raised_deterministic_errors_are_stored(
    api: APIClient, key: str, exc: str, code: int
) -> None:
    first = post(api, "/charges/", {"raise": exc}, key)
    second = post(api, "/charges/", {"raise": exc}, key)
    assert (first.status_code, second.status_code) == (code, code)
    assert second["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().response_status == code


@pytest.mark.parametrize("exc", ["validation", "parse"])
def test_validation_errors_release_the_claim(api: APIClient, key: str, exc: str) -> None:
    response = post(api, "/charges/", {"raise": exc}, key)
    assert response.status_code == 400
    assert not claims().exists()


def test_long_custom_fingerprints_and_scopes_fit_the_columns(api: APIClient, key: str) -> None:
    settings = {
        "FINGERPRINT": lambda request: "f" * 128 + request.data.get("label", ""),
        "SCOPE": lambda request: "tenant:" + "t" * 300,
    }
    with override_settings(IDEMPOTENCY=settings):
        first = post(api, "/charges/", {"label": "a"}, key)
        again = post(api, "/charges/", {"label": "a"}, key)
        other = post(api, "/charges/", {"label": "b"}, key)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert other.status_code == 422
    assert len(IdempotencyRecord.objects.get().fingerprint) == 64


def test_scopes_differing_only_by_trailing_space_are_separate(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY={"SCOPE": lambda request: "tenant:acme"}):
        post(api, "/charges/", {"label": "a"}, key)
    with override_settings(IDEMPOTENCY={"SCOPE": lambda request: "tenant:acme "}):
        other = post(api, "/charges/", {"label": "a"}, key)
    assert other.status_code == 201 and "Idempotent-Replayed" not in other
    assert IdempotencyRecord.objects.count() == 2


def test_large_multipart_upload_is_fingerprinted_by_its_files(api: APIClient, key: str) -> None:
    from django.core.files.uploadedfile import SimpleUploadedFile

    def upload(content: bytes) -> Any:
        data = {"label": "a", "file": SimpleUploadedFile("a.bin", content)}
        return api.post("/charges/", data, format="multipart", HTTP_IDEMPOTENCY_KEY=key)

    big = b"x" * (3 * 1024 * 1024)  # over DATA_UPLOAD_MAX_MEMORY_SIZE
    assert upload(big).status_code == 201
    assert upload(big)["Idempotent-Replayed"] == "true"
    assert upload(big[:-1] + b"y").status_code == 422
    assert Charge.objects.count() == 1


def test_unsupported_media_type_is_released_so_the_corrected_retry_runs(
    api: APIClient, key: str
) -> None:
    body = '{"label": "a"}'
    wrong = api.post("/charges/", body, content_type="text/plain", HTTP_IDEMPOTENCY_KEY=key)
    assert wrong.status_code == 415
    assert not claims().exists()
    again = api.post("/charges/", body, content_type="text/plain", HTTP_IDEMPOTENCY_KEY=key)
    assert again["Idempotent-Replayed"] == "true", "an uncorrected retry is served from the guard"
    fixed = api.post("/charges/", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)
    assert fixed.status_code == 201


def test_only_allow_listed_headers_are_stored(api: APIClient, key: str) -> None:
    first = post(api, "/charges-cookie/", {"label": "a"}, key)
    assert first.cookies["session"].value == "secret"
    record = IdempotencyRecord.objects.get()
    names = {name.lower() for name, _ in json.loads(record.response_headers)}
    assert names == {"content-type", "location", "idempotency-expires"}
    replay = post(api, "/charges-cookie/", {"label": "a"}, key)
    assert "session" not in replay.cookies
    assert "Authorization" not in replay and "X-Trace" not in replay


def test_extra_stored_headers_setting(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY={"STORE_HEADERS": ["X-Trace", "Set-Cookie"]}):
        post(api, "/charges-cookie/", {"label": "a"}, key)
        replay = post(api, "/charges-cookie/", {"label": "a"}, key)
    assert replay["X-Trace"] == "abc"
    assert "session" not in replay.cookies, "Set-Cookie is never stored"


def test_oversized_body_replays_status_without_body(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY={"MAX_BODY_BYTES": 10}):
        post(api, "/charges/", {"label": "a"}, key)
        replay = post(api, "/charges/", {"label": "a"}, key)
    assert replay.status_code == 201
    assert replay.content == b""
    assert replay["Idempotent-Body-Omitted"] == "true"
    assert replay["Location"].startswith("/charges/")
    assert Charge.objects.count() == 1


def test_streaming_response_is_completed_without_body(api: APIClient, key: str) -> None:
    first = post(api, "/charges-stream/", {}, key)
    assert b"".join(first.streaming_content) == b"chunkchunkchunk"
    replay = post(api, "/charges-stream/", {}, key)
    assert replay.status_code == 201 and replay["Idempotent-Body-Omitted"] == "true"
    assert Charge.objects.count() == 1


def test_disabled_is_a_pass_through(api: APIClient, key: str) -> None:
    with (
        override_settings(IDEMPOTENCY={"ENABLED": False}),
        CaptureQueriesContext(connection) as queries,
    ):
        post(api, "/charges/", {"label": "a"}, key)
        post(api, "/charges/", {"label": "a"}, key)
    assert Charge.objects.count() == 2
    assert not any("idempotency" in q["sql"] for q in queries.captured_queries)


def test_apiview_method_and_viewset_action(api: APIClient, key: str) -> None:
    charge = post(api, "/viewset-charges/", {"label": "a", "amount": 3}, None).json()
    first = post(api, f"/viewset-charges/{charge['id']}/refund/", {}, key)
    second = post(api, f"/viewset-charges/{charge['id']}/refund/", {}, key)
    assert first.status_code == 201 and second["Idempotent-Replayed"] == "true"
    assert Charge.objects.filter(amount=-3).count() == 1


def test_decorator_on_plain_function_explains_itself() -> None:
    from idempotency_app.decorators import idempotent

    @idempotent
    def view(request: Any) -> None:
        return None

    with pytest.raises(TypeError, match="@api_view"):
        view(object())


def _hold_claim(
    user: Any,
    key: str,
    operation: str,
    api: APIClient,
    fingerprint: str | None = None,
    locked_until: Any = None,
) -> IdempotencyRecord:
    """A claim held by another worker, with the fingerprint of {"label": "a"}
    unless told otherwise."""
    if fingerprint is None:
        post(api, "/charges/", {"label": "a"}, key)
        record = IdempotencyRecord.objects.get()
        fingerprint = record.fingerprint
        record.delete()
        Charge.objects.all().delete()
    now = clock.now()
    return IdempotencyRecord.objects.create(
        scope=f"user:{user.pk}",
        key=key,
        operation=operation,
        fingerprint=fingerprint,
        status="in_progress",
        token="stale-token",
        created_at=now,
        expires_at=now + timedelta(days=1),
        locked_until=locked_until or now + timedelta(seconds=60),
    )
