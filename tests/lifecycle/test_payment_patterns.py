"""The integration patterns a payments team uses, against the store's kept
cursor and the settings cache: keys in a row on one connection with large
and small bodies, nested blocks, ``on_commit``, killed sessions, racing
threads, ``service.once`` results, DEBUG and shared connections, and
``override_settings``. Every replay must be its own first response, and
every work must run once."""

from __future__ import annotations

import contextlib
import threading
import uuid

import pytest
from django.db import DatabaseError, connections
from django.test import override_settings
from rest_framework.test import APIClient

from idempotency_app import service
from tests import payment_urls
from tests.conftest import end_session, new_key, post, session_id
from tests.testapp.models import Charge, LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.payment_urls")]


@pytest.fixture(autouse=True)
def _webhooks():
    payment_urls.WEBHOOKS.clear()
    yield
    payment_urls.WEBHOOKS.clear()


@pytest.fixture(params=[False, True], ids=["autocommit", "atomic_requests"])
def atomic(request):
    conn = connections["default"]
    old = conn.settings_dict.get("ATOMIC_REQUESTS", False)
    conn.settings_dict["ATOMIC_REQUESTS"] = request.param
    yield request.param
    conn.settings_dict["ATOMIC_REQUESTS"] = old


def _body(resp):
    return resp.content


def test_keys_in_a_row_large_small_never_mixed(api, atomic):
    sizes = {"a": 100_000, "b": 10, "c": 70_000, "d": 0, "e": 65_536}
    keys = {}
    firsts = {}
    for label, size in sizes.items():
        k = new_key()
        keys[label] = k
        r = post(api, "/pay/", {"label": label, "size": size, "tag": label}, k)
        assert r.status_code == 201, r.content
        assert r.json()["label"] == label and len(r.json()["fill"]) == size
        firsts[label] = r.content
    for _ in range(3):
        for label, size in list(sizes.items()) + list(reversed(sizes.items())):
            r = post(api, "/pay/", {"label": label, "size": size, "tag": label}, keys[label])
            assert r.status_code == 201
            assert r["Idempotent-Replayed"] == "true"
            assert r.content == firsts[label], label
    assert Charge.objects.count() == len(sizes)
    assert LedgerEntry.objects.count() == len(sizes)
    assert sorted(payment_urls.WEBHOOKS) == sorted(sizes)


def test_duplicate_tag_nested_atomic_and_on_commit(api, atomic):
    k1, k2 = new_key(), new_key()
    assert post(api, "/pay/", {"label": "p", "tag": "same"}, k1).status_code == 201
    r = post(api, "/pay/", {"label": "q", "tag": "same", "size": 80_000}, k2)
    assert r.status_code == 201, r.content
    for _ in range(3):
        assert post(api, "/pay/", {"label": "p", "tag": "same"}, k1).json()["label"] == "p"
        assert (
            post(api, "/pay/", {"label": "q", "tag": "same", "size": 80_000}, k2).json()["label"]
            == "q"
        )
    assert payment_urls.WEBHOOKS == ["p", "q"]
    assert Charge.objects.count() == 2


@pytest.mark.server_db
def test_connection_killed_between_requests(api, atomic):
    k1 = new_key()
    big = post(api, "/pay/", {"label": "a", "size": 1000}, k1)
    assert big.status_code == 201
    end_session(session_id())
    # what request_started does with CONN_MAX_AGE
    conn = connections["default"]
    with contextlib.suppress(DatabaseError):  # the killed session answers with an error
        conn.cursor().execute("SELECT 1")
    conn.close_if_unusable_or_obsolete()
    if conn.connection is not None and conn.vendor != "sqlite":
        conn.close()
    k2 = new_key()
    r2 = post(api, "/pay/", {"label": "b", "size": 5}, k2)
    assert r2.status_code == 201, r2.content
    assert post(api, "/pay/", {"label": "a", "size": 1000}, k1).content == big.content
    assert post(api, "/pay/", {"label": "b", "size": 5}, k2).content == r2.content
    assert Charge.objects.count() == 2


def test_kept_cursor_killed_midway_then_recovers(api, atomic):
    """Kill the session right after a store statement used the kept cursor:
    the next request (fresh connection) must not reuse the dead cursor."""
    if connections["default"].vendor == "sqlite":
        pytest.skip("server only")
    k1 = new_key()
    assert post(api, "/pay/", {"label": "a"}, k1).status_code == 201
    conn = connections["default"]
    end_session(session_id())
    client = APIClient(raise_request_exception=False)
    client.force_authenticate(api.handler._force_user)
    r = post(client, "/pay/", {"label": "z"}, new_key())
    conn.close_if_unusable_or_obsolete()
    k3 = new_key()
    r3 = post(api, "/pay/", {"label": "c", "size": 70_000}, k3)
    assert r3.status_code == 201, r3.content
    assert post(api, "/pay/", {"label": "a"}, k1).json()["label"] == "a"
    assert post(api, "/pay/", {"label": "c", "size": 70_000}, k3).content == r3.content
    expected = ["a", "c", "z"] if r.status_code == 201 else ["a", "c"]
    assert sorted(Charge.objects.values_list("label", flat=True)) == expected


@pytest.mark.server_db
def test_racing_threads_one_execution(user, atomic):
    key = new_key()
    results = []
    barrier = threading.Barrier(8)

    def go():
        client = APIClient()
        client.force_authenticate(user)
        try:
            barrier.wait()
            for _ in range(3):
                r = post(client, "/pay/", {"label": "r", "size": 70_000}, key)
                results.append((r.status_code, r.content if r.status_code == 201 else None))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Charge.objects.count() == 1
    assert LedgerEntry.objects.count() == 1
    bodies = {c for s, c in results if s == 201}
    assert len(bodies) == 1
    assert {s for s, _ in results} <= {201, 409}
    assert payment_urls.WEBHOOKS == ["r"]


def test_service_once_two_keys_same_connection_large_results():
    scope = "celery:" + uuid.uuid4().hex
    outs = {}
    for i, size in enumerate([100_000, 3, 70_000, 0]):
        k = f"task-{i}"
        with service.once(scope, k, "export") as run:
            if run.should_execute:
                Charge.objects.create(label=k)
                run.result = {"k": k, "data": "x" * size}
        outs[k] = run.result
    for _ in range(3):
        for k, expected in outs.items():
            with service.once(scope, k, "export") as run:
                assert not run.should_execute
            assert run.result == expected
    assert Charge.objects.count() == 4


def test_debug_toggle_and_thread_sharing_between_requests(api, settings):
    k1 = new_key()
    r1 = post(api, "/pay/", {"label": "a", "size": 70_000}, k1)
    settings.DEBUG = True
    k2 = new_key()
    r2 = post(api, "/pay/", {"label": "b", "size": 1}, k2)
    settings.DEBUG = False
    conn = connections["default"]
    conn.inc_thread_sharing()
    try:
        assert post(api, "/pay/", {"label": "a", "size": 70_000}, k1).content == r1.content
    finally:
        conn.dec_thread_sharing()
    assert post(api, "/pay/", {"label": "b", "size": 1}, k2).content == r2.content
    assert Charge.objects.count() == 2


def test_override_idempotency_settings_takes_effect(api):
    k = new_key()
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        post(api, "/pay/", {"label": "a"}, k)
        post(api, "/pay/", {"label": "a"}, k)
    assert Charge.objects.count() == 2
    post(api, "/pay/", {"label": "b"}, k)
    post(api, "/pay/", {"label": "b"}, k)
    assert Charge.objects.count() == 3
