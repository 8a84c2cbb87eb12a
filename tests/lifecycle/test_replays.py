"""REPLAY_CACHE: retries answered from the process's own memory, within the
staleness it promises and no further.

What could go wrong: a replay of another request's response (a different
body under the same key), a response an operator expired still replayed by
the process that expired it, an entry outliving REPLAY_CACHE seconds, memory
without bound, and (across processes, the documented limit) a stale replay
for longer than REPLAY_CACHE.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from idempotency_app import service, signals
from idempotency_app.lifecycle import replays
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import Identity, StoredResponse
from tests.conftest import needs_server_db, new_key, operator, post, replay_cache as cached
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"label": "a", "amount": 5}


def held(key: str) -> Any:
    record = IdempotencyRecord.objects.get(key=key)
    return replays.get(
        Identity(record.scope, record.key, record.operation, record.fingerprint), "default"
    )


def statements(call: Any) -> tuple[int, Any]:
    with CaptureQueriesContext(connection) as captured:
        result = call()
    return len(captured.captured_queries), result


def test_off_by_default_a_replay_reads_the_database(api: APIClient, key: str) -> None:
    post(api, "/charges/", BODY, key)
    count, response = statements(lambda: post(api, "/charges/", BODY, key))
    assert response["Idempotent-Replayed"] == "true"
    assert count >= 1


def test_a_retry_of_a_request_this_process_completed_sends_no_statement(
    api: APIClient, key: str
) -> None:
    with cached():
        first = post(api, "/charges/", BODY, key)
        count, again = statements(lambda: post(api, "/charges/", BODY, key))
    assert again["Idempotent-Replayed"] == "true"
    assert (again.status_code, again.json()) == (first.status_code, first.json())
    assert count == 0
    assert Charge.objects.count() == 1


def test_a_replay_read_from_the_database_is_held_too(api: APIClient, key: str) -> None:
    post(api, "/charges/", BODY, key)  # completed while the cache was off
    with cached():
        assert statements(lambda: post(api, "/charges/", BODY, key))[0] >= 1
        count, again = statements(lambda: post(api, "/charges/", BODY, key))
    assert again["Idempotent-Replayed"] == "true" and count == 0


class Boom(Exception):
    pass


def once_replayed_inside_a_transaction(key: str) -> None:
    """A duplicate's ``once()`` block, inside the caller's transaction,
    writes and then fails; the caller catches it and carries on."""
    with transaction.atomic():
        try:
            with service.once("replays", key, "replays.op") as run:
                assert run.replayed
                Charge.objects.create(label="written-by-a-replayed-block")
                raise Boom
        except Boom:
            pass


def complete_once(key: str) -> None:
    with service.once("replays", key, "replays.op") as run:
        if run.should_execute:
            run.result = {"ok": 1}


@pytest.mark.parametrize("held_in_memory", [False, True])
def test_a_replayed_block_inside_a_transaction_rolls_back_with_its_savepoint(
    key: str, held_in_memory: bool
) -> None:
    """A replay from memory, like one read from the database, runs the
    block in the claim's savepoint inside the caller's transaction: its
    writes roll back when it fails."""
    with cached(5 if held_in_memory else 0):
        complete_once(key)
        assert bool(replays._entries) is held_in_memory
        once_replayed_inside_a_transaction(key)
    assert Charge.objects.filter(label="written-by-a-replayed-block").count() == 0


def test_a_held_replay_is_counted_and_timed_once_wherever_it_is_asked(
    api: APIClient, key: str
) -> None:
    """Through a view inside a transaction, ``once()`` and ``service.claim``:
    one ``replayed`` and one ``claim_timed`` each, decided as a replay."""
    timed: list[str] = []
    replayed: list[Any] = []

    def on_timed(decision: Any = None, **kwargs: Any) -> None:
        timed.append(type(decision).__name__)

    def on_replayed(sender: Any, **kwargs: Any) -> None:
        replayed.append(sender)

    block_key, claim_key = new_key(), new_key()
    with cached():
        post(api, "/charges/", BODY, key)
        complete_once(block_key)
        service.complete(service.claim("replays", claim_key, "replays.claim"), {"x": 1})
        signals.claim_timed.connect(on_timed, weak=False)
        signals.replayed.connect(on_replayed, weak=False)
        try:
            with transaction.atomic():
                count, again = statements(lambda: post(api, "/charges/", BODY, key))
            complete_once(block_key)
            assert isinstance(service.claim("replays", claim_key, "replays.claim"), service.Done)
        finally:
            signals.claim_timed.disconnect(on_timed)
            signals.replayed.disconnect(on_replayed)
    assert again["Idempotent-Replayed"] == "true"
    assert count == 2, "the claim's SAVEPOINT and RELEASE inside the caller's transaction"
    assert timed == ["Replay", "Replay", "Replay"]
    assert len(replayed) == 3


def test_another_request_under_the_same_key_is_judged_by_the_database(
    api: APIClient, key: str
) -> None:
    with cached():
        post(api, "/charges/", BODY, key)
        other = post(api, "/charges/", {**BODY, "amount": 6}, key)
        elsewhere = post(api, "/mixin-charges/", BODY, key)
    assert other.status_code == 422
    assert elsewhere.status_code == 422


def test_an_entry_lasts_replay_cache_seconds(
    api: APIClient, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(replays.time, "monotonic", lambda: now[0])
    with cached(2):
        post(api, "/charges/", BODY, key)
        now[0] += 1.9
        assert statements(lambda: post(api, "/charges/", BODY, key))[0] == 0
        now[0] += 0.2
        count, again = statements(lambda: post(api, "/charges/", BODY, key))
    assert again["Idempotent-Replayed"] == "true"
    assert count >= 1, "older than REPLAY_CACHE: read again"


def test_an_expire_in_the_admin_empties_this_processs_cache(
    api: APIClient, user: User, key: str
) -> None:
    with cached():
        post(api, "/charges/", BODY, key)
        record = IdempotencyRecord.objects.get(key=key)
        admin = operator(user)
        response = admin.post(
            "/admin/idempotency_app/idempotencyrecord/",
            {"action": "expire_records", "_selected_action": [record.pk], "post": "yes"},
        )
        assert response.status_code == 302
        again = post(api, "/charges/", BODY, key)
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 2


def test_a_release_in_the_admin_empties_it_too(api: APIClient, user: User, key: str) -> None:
    with cached():
        post(api, "/charges/", BODY, key)
        assert held(key) is not None
        admin = operator(user)
        admin.post(
            "/admin/idempotency_app/idempotencyrecord/",
            {"action": "release_claims", "_selected_action": [0]},
        )
        assert held(key) is None


def test_switched_off_it_holds_nothing_it_held_before(api: APIClient, key: str) -> None:
    """A test suite turns the cache on for one test, then flushes the
    database: with the cache off, a retry must ask the database, not get
    the response a process held while it was on."""
    with cached(30):
        post(api, "/charges/", BODY, key)
        assert held(key) is not None
    IdempotencyRecord.objects.filter(key=key).delete()  # as a flush between tests would
    again = post(api, "/charges/", BODY, key)
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 2


def test_a_flush_of_the_database_empties_it(api: APIClient, key: str) -> None:
    """``flush`` (what ``TransactionTestCase`` and pytest-django's
    ``transactional_db`` run between tests) forgets every key: so does the
    cache, or the next test's request under a key an earlier test sent
    would get that test's response."""
    from django.core.management import call_command

    with cached(30):
        post(api, "/charges/", BODY, key)
        call_command("flush", interactive=False, verbosity=0)
        again = post(api, "/charges/", BODY, key)
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 1  # the first one went with the flush


def test_a_test_case_with_available_apps_leaves_nothing_for_the_next() -> None:
    """A ``TransactionTestCase`` with ``available_apps`` flushes without
    ``post_migrate``; it names ``INSTALLED_APPS`` as it tears down, which
    empties the cache, so the next test case's request under the same key,
    scope and body runs."""
    import io
    import unittest

    from django.test import TransactionTestCase

    seen: dict[str, Any] = {}

    def charge_as(username: str) -> Any:
        """The same key, body and principal id in each test, as fixtures
        would give them."""
        client = APIClient()
        client.force_authenticate(User.objects.create(pk=4244, username=username))
        response = post(client, "/charges/", BODY, "a-key-both-tests-send")
        seen[username] = response.json()
        return response

    class FastTests(TransactionTestCase):
        available_apps = [
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "rest_framework",
            "idempotency_app",
            "tests.testapp",
        ]

        def test_alice_charges(self) -> None:
            self.assertEqual(charge_as("alice").status_code, 201)

    class NextTests(TransactionTestCase):
        def test_bob_charges(self) -> None:
            self.assertNotIn("Idempotent-Replayed", charge_as("bob"))
            self.assertEqual(Charge.objects.count(), 1)

    loader = unittest.TestLoader()
    suite = unittest.TestSuite(
        [loader.loadTestsFromTestCase(FastTests), loader.loadTestsFromTestCase(NextTests)]
    )
    out = io.StringIO()
    with cached(30):  # as a project's settings would have it
        result = unittest.TextTestRunner(stream=out, verbosity=2).run(suite)
    assert result.wasSuccessful(), f"{seen}\n{out.getvalue()}"


def test_settings_changed_under_it_empty_it(api: APIClient, key: str) -> None:
    """Whatever the change (another database alias, a shorter window), what
    was held under the old settings is not replayed under the new ones."""
    with cached(30):
        post(api, "/charges/", BODY, key)
        with cached(5):
            count, again = statements(lambda: post(api, "/charges/", BODY, key))
    assert again["Idempotent-Replayed"] == "true"
    assert count >= 1, "held under other settings: read again"


def test_entries_are_bounded(api: APIClient) -> None:
    with cached(REPLAY_CACHE_ENTRIES=2):
        for key in ("k-1", "k-2", "k-3"):
            post(api, "/charges/", BODY, key)
        newest = [
            statements(lambda key=key: post(api, "/charges/", BODY, key))[0]
            for key in ("k-3", "k-2")
        ]
        oldest, _ = statements(lambda: post(api, "/charges/", BODY, "k-1"))
    assert newest == [0, 0]
    assert oldest >= 1, "the oldest entry was dropped"


def test_a_large_body_is_not_held() -> None:
    identity = Identity("user:1", "k", "POST charges/", "f" * 64)
    with cached():
        replays.put(
            identity,
            "default",
            StoredResponse(201, (), b"x" * replays.MAX_ENTRY_BYTES),
            replays.generation(),
        )
        assert replays.get(identity, "default") is not None
        big = StoredResponse(201, (), b"x" * (replays.MAX_ENTRY_BYTES + 1))
        replays.put(identity, "default", big, replays.generation())
        assert replays.get(identity, "default") is None


# -- across processes: the documented limit -----------------------------------


def _replay_in_child(user_pk: int, key: str, go: Any, answers: Any) -> None:
    """Another process: it replays the key once (and holds it), then again
    when told, then again once REPLAY_CACHE has passed."""
    try:
        replays.clear()  # a process of its own: nothing inherited
        client = APIClient()
        client.force_authenticate(User.objects.get(pk=user_pk))
        with cached(1):
            answers.put(post(client, "/charges/", BODY, key).json()["id"])
            go.wait(30)
            answers.put(post(client, "/charges/", BODY, key).json()["id"])
            time.sleep(1.1)
            answers.put(post(client, "/charges/", BODY, key).json()["id"])
    except Exception as exc:  # reported, so the test sees it
        answers.put(repr(exc))
    finally:
        connections.close_all()


@needs_server_db
def test_another_process_replays_what_it_holds_for_at_most_replay_cache_seconds(
    api: APIClient, user: User, key: str
) -> None:
    with cached(1):
        first = post(api, "/charges/", BODY, key).json()["id"]
        connections.close_all()
        context = multiprocessing.get_context("fork")
        go, answers = context.Event(), context.Queue()
        child = context.Process(target=_replay_in_child, args=(user.pk, key, go, answers))
        child.start()
        assert answers.get(timeout=30) == first
        record = IdempotencyRecord.objects.get(key=key)
        operator(user).post(
            "/admin/idempotency_app/idempotencyrecord/",
            {"action": "expire_records", "_selected_action": [record.pk], "post": "yes"},
        )
        second = post(api, "/charges/", BODY, key).json()["id"]  # this process: runs again
        go.set()
        stale, fresh = answers.get(timeout=30), answers.get(timeout=30)
        child.join(30)
    assert second != first
    assert stale == first, "within REPLAY_CACHE the other process still replays what it held"
    assert fresh == second, "after REPLAY_CACHE it reads the database again"
