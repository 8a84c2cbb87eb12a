"""What the service API raises, each saying what to do next."""

from __future__ import annotations

from idempotency_app import core

StoreUnavailable = core.StoreUnavailable
OutcomeUnknown = core.OutcomeUnknown


class KeyInProgress(Exception):
    """Another worker holds the key: retry later (a queue's retry fits)."""

    def __init__(self, key: str, retry_after: int = 1) -> None:
        super().__init__(
            f"Idempotency key {key!r} is being processed by another worker; "
            f"retry in {retry_after}s or more to get its result."
        )
        self.key = key
        self.retry_after = retry_after


class ClaimLost(KeyInProgress):
    """Our lease ran out and another worker took the key over; our work was
    rolled back, and a retry gets the new owner's result."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.args = (
            f"The claim on idempotency key {key!r} was taken over after its lease "
            "ran out; this worker's work was rolled back. Raise the lease above "
            "the slowest run, or call renew() while working.",
        )


class WorkRolledBack(Exception):
    """The work's transaction was marked for rollback (a caught database
    error, ``set_rollback(True)``) or failed to commit: nothing it did was
    kept, no result was stored and the key was released, so a retry runs
    the work again."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"The work on idempotency key {key!r} was rolled back, so nothing was stored; "
            "a retry runs it again. Wrap a statement whose database error you catch in its "
            "own transaction.atomic()."
        )
        self.key = key


class KeyReused(Exception):
    """The key was already used for another operation or fingerprint."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"Idempotency key {key!r} was already used for a different operation "
            "or fingerprint; use a new key for different work."
        )
        self.key = key
