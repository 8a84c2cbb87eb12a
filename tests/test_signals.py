"""What a project connects to the library's signals, and when, is what is
called; and a project may send them itself, with any sender."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from idempotency_app import signals
from idempotency_app.lifecycle.claims import Claim
from idempotency_app.store import Identity
from tests.conftest import new_key, post


def test_receivers_connected_and_disconnected_between_requests_are_seen(api: APIClient) -> None:
    replays: list[str] = []
    timings: list[Any] = []

    def on_replay(sender: Any, identity: Any, **kwargs: Any) -> None:
        replays.append(identity.key)

    def on_claim(sender: Any, decision: Any = None, **kwargs: Any) -> None:
        timings.append(type(decision).__name__)

    key = new_key()
    assert post(api, "/charges/", {"amount": 1}, key).status_code == 201
    assert post(api, "/charges/", {"amount": 1}, key).status_code == 201  # sent, not received
    signals.replayed.connect(on_replay, sender=Claim, weak=False)
    signals.claim_timed.connect(on_claim, weak=False)
    try:
        assert post(api, "/charges/", {"amount": 1}, key).status_code == 201
        assert replays == [key]
        assert timings == ["Replay"]
    finally:
        signals.replayed.disconnect(on_replay, sender=Claim)
        signals.claim_timed.disconnect(on_claim)
    assert post(api, "/charges/", {"amount": 1}, key).status_code == 201
    assert replays == [key] and timings == ["Replay"]


def test_a_receiver_for_another_sender_is_not_called(api: APIClient) -> None:
    called: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        called.append(sender)

    signals.replayed.connect(receiver, sender=object, weak=False)
    try:
        key = new_key()
        post(api, "/charges/", {"amount": 1}, key)
        assert post(api, "/charges/", {"amount": 1}, key).status_code == 201
    finally:
        signals.replayed.disconnect(receiver, sender=object)
    assert called == []


@pytest.mark.parametrize("sender", [None, "a-string", 1])
def test_a_signal_may_be_sent_with_any_sender(sender: Any) -> None:
    got: list[Any] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        got.append(sender)

    signals.executed.connect(receiver, weak=False)
    try:
        signals.executed.send(sender, identity=Identity("s", "k", "op", "fp"), status=201)
    finally:
        signals.executed.disconnect(receiver)
    assert got == [sender]
