"""The patterns a payments team writes with Django, each tried against the
promise: a client gets a success, and every retry its replay, only for work
that committed, once. Views are in ``tests/testapp/patterns.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections
from django.db.models.signals import post_save
from django.test.utils import override_settings
from rest_framework.test import APIClient

from idempotency_app.decorators import idempotent
from idempotency_app.mixins import IdempotentMixin
from idempotency_app.models import IdempotencyRecord
from tests.conftest import post
from tests.testapp import patterns
from tests.testapp.models import AuditEntry, Charge, LedgerEntry, Tag

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])

URL = "/patterns/"


@pytest.fixture
def atomic_requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    yield


def record_count() -> int:
    return IdempotencyRecord.objects.count()


def assert_rolled_back(response: Any) -> None:
    """Not a success: the 500 says the work did not happen, and nothing is kept."""
    assert response.status_code == 500, response.content
    assert response.json()["code"] == "request_rolled_back"
    assert Charge.objects.count() == 0
    assert record_count() == 0, "the key is released, so a retry runs again"


# -- 1. a success whose transaction rolled back -----------------------------


@pytest.mark.parametrize(
    "view", ["tag-if-new", "inner-block-without-savepoint"], ids=["no-atomic", "savepoint-false"]
)
def test_a_caught_database_error_is_never_a_silent_success(
    api: APIClient, key: str, view: str
) -> None:
    Tag.objects.create(name="vip")
    without_key = post(api, f"{URL}{view}/", {"tag": "vip"}, None)
    assert without_key.status_code == 201, "without a key the view works: autocommit"
    Charge.objects.all().delete()
    assert_rolled_back(post(api, f"{URL}{view}/", {"tag": "vip"}, key))


def test_the_advised_pattern_commits_and_replays(api: APIClient, key: str) -> None:
    Tag.objects.create(name="vip")
    first = post(api, f"{URL}tag-if-new-atomic/", {"tag": "vip"}, key)
    again = post(api, f"{URL}tag-if-new-atomic/", {"tag": "vip"}, key)
    assert first.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_set_rollback_in_a_succeeding_view_is_not_a_success(api: APIClient, key: str) -> None:
    assert_rolled_back(post(api, f"{URL}rolls-back-on-purpose/", {}, key))


def test_set_rollback_under_atomic_requests(
    api: APIClient, key: str, atomic_requests: None
) -> None:
    without_key = post(api, f"{URL}rolls-back-on-purpose/", {}, None)
    assert without_key.status_code == 201 and Charge.objects.count() == 0
    assert_rolled_back(post(api, f"{URL}rolls-back-on-purpose/", {}, key))


def test_a_handler_that_answers_200_for_rolled_back_work(
    api: APIClient, key: str, atomic_requests: None
) -> None:
    """DRF's handler marks the request's transaction for rollback; a custom
    handler turning the exception into a 200 must not make it a success."""
    assert_rolled_back(post(api, f"{URL}forgiving/", {}, key))


def test_a_handler_that_answers_200_in_atomic_mode_is_stored(api: APIClient, key: str) -> None:
    """Without ATOMIC_REQUESTS nothing marks the transaction: the 200 and
    the work commit together, as the view's writes would without a key."""
    first = post(api, f"{URL}forgiving/", {}, key)
    again = post(api, f"{URL}forgiving/", {}, key)
    assert first.status_code == 200 and again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_commit_that_fails_is_not_a_success(quiet_api: APIClient, key: str) -> None:
    """A deferred foreign key fails at COMMIT (PostgreSQL, SQLite); MySQL
    checks it at once, so the view itself fails. Never a 201."""
    response = post(quiet_api, f"{URL}dangling-foreign-key/", {}, key)
    assert response.status_code == 500
    if connection.vendor != "mysql":
        assert response.json()["code"] == "request_rolled_back"
    assert (Charge.objects.count(), LedgerEntry.objects.count(), record_count()) == (0, 0, 0)


# -- 2. writes that cannot commit with the outcome ---------------------------


def test_a_write_to_another_database_is_refused_before_it_happens(
    quiet_api: APIClient, key: str
) -> None:
    without_key = post(quiet_api, f"{URL}writes-to-other-database/", {}, None)
    assert without_key.status_code == 201
    assert AuditEntry.objects.using("other").count() == 1
    response = post(quiet_api, f"{URL}writes-to-other-database/", {}, key)
    assert response.status_code == 500
    assert AuditEntry.objects.using("other").count() == 1, "the refused write never ran"
    assert Charge.objects.count() == 1, "only the keyless request's charge"
    assert record_count() == 0


class ToOther:
    """A router that sends the audit log to another database."""

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return "other" if model is AuditEntry else None

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.db_for_write(model)


def test_a_routed_write_that_the_view_swallows_still_fails(quiet_api: APIClient, key: str) -> None:
    with override_settings(DATABASE_ROUTERS=[ToOther()]):
        response = post(quiet_api, f"{URL}swallows-other-database-error/", {}, key)
    assert response.status_code == 500, "a caught refusal is still no success"
    assert (Charge.objects.count(), AuditEntry.objects.using("other").count()) == (0, 0)
    assert record_count() == 0


def test_reads_from_another_database_are_fine(api: APIClient, key: str) -> None:
    first = post(api, f"{URL}reads-other-database/", {}, key)
    assert first.status_code == 201
    assert post(api, f"{URL}reads-other-database/", {}, key)["Idempotent-Replayed"] == "true"


def test_a_durable_block_is_refused_with_its_fix(user: User, key: str) -> None:
    client = APIClient()
    client.force_authenticate(user)
    with pytest.raises(RuntimeError, match="Remove durable=True") as raised:
        post(client, f"{URL}durable-block/", {}, key)
    assert "durable" in str(raised.value.__cause__)
    assert (Charge.objects.count(), record_count()) == (0, 0)
    assert post(client, f"{URL}durable-block/", {}, None).status_code == 201


# -- 3. handlers calling handlers ---------------------------------------------


def test_partial_update_calling_a_decorated_update_runs_once(api: APIClient, key: str) -> None:
    charge = Charge.objects.create(label="old", amount=5)
    url = f"/nested-charges/{charge.pk}/"
    first = api.patch(url, {"label": "new"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    again = api.patch(url, {"label": "new"}, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == 200, first.content
    assert again.status_code == 200 and again["Idempotent-Replayed"] == "true"
    assert Charge.objects.get().label == "new"
    assert IdempotencyRecord.objects.get().status == "completed"


def test_update_called_directly_is_idempotent_on_its_own(api: APIClient, key: str) -> None:
    charge = Charge.objects.create(label="old", amount=5)
    url = f"/nested-charges/{charge.pk}/"
    body = {"label": "put", "amount": 7}
    first = api.put(url, body, format="json", HTTP_IDEMPOTENCY_KEY=key)
    assert first.status_code == 200
    assert api.put(url, body, format="json", HTTP_IDEMPOTENCY_KEY=key)["Idempotent-Replayed"]


# -- the rest of a view's toolbox ---------------------------------------------


def test_commit_hooks_run_once_after_the_commit(api: APIClient, key: str) -> None:
    patterns.HOOK_CALLS.clear()
    first = post(api, f"{URL}with-commit-hooks/", {}, key)
    post(api, f"{URL}with-commit-hooks/", {}, key)
    assert [first.json()["charge"]] == patterns.HOOK_CALLS


def test_a_failing_commit_hook_keeps_the_committed_outcome(quiet_api: APIClient, key: str) -> None:
    """The hook fails after the commit, as Django reports it (a 500); the
    work and its outcome committed, so the retry replays, not reruns."""
    patterns.HOOK_CALLS.clear()
    first = post(quiet_api, f"{URL}with-commit-hooks/", {"hook_fails": True}, key)
    assert first.status_code == 500
    again = post(quiet_api, f"{URL}with-commit-hooks/", {"hook_fails": True}, key)
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1 and len(patterns.HOOK_CALLS) == 1


def test_select_for_update_inside_the_view(api: APIClient, key: str) -> None:
    charge = Charge.objects.create(label="locked", amount=1)
    first = post(api, f"{URL}locks-a-row/", {"charge": charge.pk}, key)
    again = post(api, f"{URL}locks-a-row/", {"charge": charge.pk}, key)
    assert first.json()["amount"] == 2 and again["Idempotent-Replayed"] == "true"
    charge.refresh_from_db()
    assert charge.amount == 2


def test_model_signal_writes_commit_with_the_outcome(quiet_api: APIClient, key: str) -> None:
    def ledger(sender: Any, instance: Charge, created: bool, **kwargs: Any) -> None:
        if created:
            LedgerEntry.objects.create(charge=instance, amount=instance.amount)

    post_save.connect(ledger, sender=Charge, dispatch_uid="test-ledger")
    try:
        assert post(quiet_api, f"{URL}rolls-back-on-purpose/", {}, key).status_code == 500
        assert LedgerEntry.objects.count() == 0, "the receiver's write rolled back with the view's"
        assert post(quiet_api, f"{URL}tag-if-new-atomic/", {"tag": "x"}, key).status_code == 201
        assert LedgerEntry.objects.count() == 1
    finally:
        post_save.disconnect(dispatch_uid="test-ledger", sender=Charge)


def test_compressed_attachments_replay_with_their_headers(api: APIClient, key: str) -> None:
    first = post(api, f"{URL}attachment/", {}, key)
    again = post(api, f"{URL}attachment/", {}, key)
    assert again["Idempotent-Replayed"] == "true"
    for name in ("Content-Encoding", "Content-Disposition", "Content-Type"):
        assert again[name] == first[name], name
    assert again.content == first.content


def upload(api: APIClient, body: bytes, key: str | None) -> Any:
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return api.post(
        f"{URL}upload/statement.csv/", body, content_type="application/octet-stream", **headers
    )


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000, FILE_UPLOAD_MAX_MEMORY_SIZE=500)
def test_a_raw_upload_over_the_body_limit_works_with_a_key(api: APIClient, key: str) -> None:
    body = b"x" * 5000
    assert upload(api, body, None).status_code == 201, "DRF's parser streams it without a key"
    first = upload(api, body, key)
    assert first.status_code == 201, first.content
    assert first.json()["size"] == 5000
    assert upload(api, body, key)["Idempotent-Replayed"] == "true"
    assert upload(api, b"y" * 5000, key).status_code == 422, "other bytes, another request"
    assert Charge.objects.count() == 2


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_large_json_is_answered_as_without_a_key(quiet_api: APIClient, key: str) -> None:
    """Whether DRF's JSONParser streams the body (before 3.16) or reads
    ``request.body`` (later, refused over the limit), a key changes nothing."""
    data = {"label": "big", "padding": "z" * 4000}
    without_key = post(quiet_api, "/charges/", data, None).status_code
    with_key = post(quiet_api, "/charges/", data, key)
    assert with_key.status_code == without_key, with_key.content
    if without_key == 201:
        assert post(quiet_api, "/charges/", data, key)["Idempotent-Replayed"] == "true"
    else:
        assert record_count() == 0


# -- content negotiation -------------------------------------------------------


def test_a_replay_the_client_does_not_accept_is_406_and_never_reruns(
    api: APIClient, key: str
) -> None:
    first = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT="application/json")
    refused = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT="text/html")
    assert first.status_code == 201
    assert refused.status_code == 406, "rendered as the client asked: an HTML page"
    assert b"idempotency_replay_not_acceptable" in refused.content
    assert b"application/json" in refused.content
    assert Charge.objects.count() == 1
    again = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT="text/html, */*;q=0.1")
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"


def test_a_browsable_api_page_is_not_replayed_to_a_json_client(api: APIClient, key: str) -> None:
    html = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT="text/html")
    assert html.status_code == 201 and html["Content-Type"].startswith("text/html")
    json_client = post(api, "/charges/", {"label": "a"}, key, HTTP_ACCEPT="application/json")
    assert json_client.status_code == 406
    forced = api.post(
        "/charges/?format=json",
        json.dumps({"label": "a"}),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert forced.status_code == 406, "?format=json asks for JSON whatever Accept says"
    assert Charge.objects.count() == 1


# -- identity ----------------------------------------------------------------


def test_the_empty_route_is_the_operation(api: APIClient, key: str) -> None:
    assert post(api, "/", {}, key).status_code == 201
    assert IdempotencyRecord.objects.get().operation == "POST "


def test_operations_too_long_for_the_column_are_hashed_not_cut() -> None:
    from django.test import RequestFactory

    from idempotency_app.http import keys

    factory = RequestFactory()
    long_a = factory.post("/" + "a" * 300 + "/one")
    long_b = factory.post("/" + "a" * 300 + "/two")
    assert keys.operation(long_a) != keys.operation(long_b)
    assert len(keys.operation(long_a)) <= 255


def test_a_corrected_content_type_is_a_new_request_for_the_guard(api: APIClient, key: str) -> None:
    body = json.dumps({"label": "a"})
    wrong = api.post("/charges/", body, content_type="text/plain", HTTP_IDEMPOTENCY_KEY=key)
    assert wrong.status_code == 415
    fixed = api.post("/charges/", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key)
    assert fixed.status_code == 201, "the cached 415 answers only the identical request"
    assert "Idempotent-Replayed" not in fixed


def test_the_guard_never_answers_for_another_endpoint(api: APIClient, key: str) -> None:
    assert post(api, f"{URL}constant-fingerprint-a/", {"invalid": True}, key).status_code == 400
    other = post(api, f"{URL}constant-fingerprint-b/", {}, key)
    assert other.status_code == 201 and other.json()["endpoint"] == "b"


# -- options -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"methods": ["GET", "POST"]}, "safe methods"),
        ({"methods": "POST"}, "list of HTTP methods"),
        ({"lease": 5, "wait": 10}, "WAIT_FOR_IN_FLIGHT"),
        ({"ttl": 0}, "TTL"),
        ({"lease": float("nan")}, "LEASE"),
        ({"wait": "10"}, "number of seconds"),
    ],
)
def test_unsafe_view_options_fail_when_decorated(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=message):
        idempotent(**options)(lambda request: None)
    with pytest.raises(ImproperlyConfigured, match=message):
        type(
            "View",
            (IdempotentMixin,),
            {f"idempotency_{name}": value for name, value in options.items()},
        )


def test_a_view_lease_below_the_settings_wait_is_refused_at_request_time(
    quiet_api: APIClient, key: str
) -> None:
    from tests.testapp.views import AccountChargeView

    with (
        override_settings(IDEMPOTENCY={"WAIT_FOR_IN_FLIGHT": 10, "LEASE": 60}),
        pytest.MonkeyPatch.context() as patch,
    ):
        handler = AccountChargeView.post
        unsafe = idempotent(lease=5)(handler.__wrapped__)  # type: ignore[attr-defined]
        patch.setattr(AccountChargeView, "post", unsafe)
        response = post(quiet_api, "/accounts/1/charges/", {}, key)
    assert response.status_code == 500
    assert Charge.objects.count() == 0 and record_count() == 0


def test_safe_methods_never_claim(api: APIClient, key: str) -> None:
    with override_settings(IDEMPOTENCY={"METHODS": ["GET", "POST"]}):
        response = api.get("/viewset-charges/", HTTP_IDEMPOTENCY_KEY=key)
    assert response.status_code == 200
    assert record_count() == 0


# -- MySQL character sets -----------------------------------------------------


@pytest.mark.mysql  # its connection charsets
def test_a_narrow_mysql_connection_never_claims_a_mangled_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from idempotency_app import service, store

    connections["default"].close()
    store.backend.cache_clear()
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "charset", "utf8")
    try:
        with pytest.raises(ValueError, match="utf8mb4"):
            service.claim("webhooks", "evt_😀", "op")
        assert record_count() == 0
        held = service.claim("webhooks", "evt_????", "op")
        assert isinstance(held, service.Held), "an unrelated key is not taken"
        service.complete(held, {"ok": 1})
    finally:
        connections["default"].close()
        store.backend.cache_clear()
        monkeypatch.undo()


@pytest.mark.mysql  # its data errors
def test_a_mysql_data_error_on_claim_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """INSERT IGNORE would turn a value the column cannot hold into a
    warning and report the mangled key as claimed."""
    from idempotency_app import store
    from idempotency_app.exceptions import StoreUnavailable
    from idempotency_app.lifecycle.claims import Policy, claim

    identity = store.Identity("s", "k", "op", "f" * 65)  # one character over the column
    with pytest.raises(StoreUnavailable):
        claim(identity, Policy.from_settings())
    assert record_count() == 0


# -- USE_TZ = False ------------------------------------------------------------


@override_settings(USE_TZ=False)
def test_without_time_zone_support_leases_and_expiry_still_hold(api: APIClient, key: str) -> None:
    from io import StringIO

    from django.core.management import call_command

    from idempotency_app import clock, service

    first = post(api, "/charges/", {"label": "a"}, key)
    assert first.status_code == 201
    assert post(api, "/charges/", {"label": "a"}, key)["Idempotent-Replayed"] == "true"
    with clock.freeze():
        held = service.claim("tasks", "job-1", "op", lease=60)
        assert isinstance(held, service.Held)
        with pytest.raises(service.KeyInProgress):
            service.claim("tasks", "job-1", "op", lease=60)
        clock.advance(61)
        assert isinstance(service.claim("tasks", "job-1", "op"), service.Held), "taken over"
        clock.advance(25 * 3600)
        out = StringIO()
        call_command("sweep_idempotency", stdout=out)
    assert out.getvalue().startswith("Deleted 2 expired records and 0 stale claims in ")
    assert Charge.objects.count() == 1
