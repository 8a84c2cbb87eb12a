"""Claiming a key: one INSERT arbitrated by the unique constraint decides
who runs.

A claim is held one of two ways, each a type that knows how its work
commits and how it is let go:

- ``AtomicClaim``, made outside any transaction: it commits on its own,
  before the work, so a concurrent duplicate sees it at once (409, not a
  wait); the work then runs in a transaction of its own that also stores its
  outcome; letting go is a DELETE (or a validation error's marker).
- ``NestedClaim``, made inside the caller's transaction (``ATOMIC_REQUESTS``,
  or the caller's own ``atomic()``): the claim cannot commit first, so claim,
  work and outcome share one savepoint (``units.claimed`` opens it), letting
  go is that savepoint's rollback, and a duplicate waits at the INSERT until
  the caller commits, then replays.

A claim that meets a record replays it, refuses it (``KeyReused``,
``KeyInProgress``, ``OutcomeUnknown``) or takes it over: the one decision
``takeover`` makes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.db import Error, InterfaceError, OperationalError, connections, transaction

from idempotency_app import signals, store
from idempotency_app.conf import conf, policy_problems, to_seconds
from idempotency_app.exceptions import KeyInProgress, KeyReused, OutcomeUnknown, StoreUnavailable
from idempotency_app.lifecycle import replays
from idempotency_app.lifecycle.drivers import is_lock_conflict
from idempotency_app.lifecycle.work import UnitAtomic
from idempotency_app.store import Existing, Identity, StoredResponse
from idempotency_app.store.base import runs_alone

logger = logging.getLogger("idempotency_app")

# How often a claim is retried when the record it met vanished or was taken
# over by someone else in between; each retry is a fresh INSERT.
MAX_CLAIM_ATTEMPTS = 5
POLL_INTERVAL = 0.05


def derive_key(scope: str, key: str, label: str) -> str:
    """A stable key for a call to a downstream API made while handling ``key``.

    The same (scope, key, label) always gives the same 64 hex characters, so
    a retried job sends its payment provider the key it sent the first time.
    Never change this function: keys already sent depend on it.
    """
    digest = hashlib.sha256()
    for part in (scope, key, label):
        raw = part.encode("utf-8", "surrogateescape")
        digest.update(len(raw).to_bytes(8, "big"))
        digest.update(raw)
    return digest.hexdigest()


@dataclass(frozen=True)
class Policy:
    ttl: float
    lease: float
    wait: float
    using: str
    # How long a released claim leaves its marker (TRANSIENT_ERROR_TTL).
    marker: float = 0.0

    @classmethod
    def from_settings(
        cls, ttl: float | None = None, lease: float | None = None, wait: float | None = None
    ) -> Policy:
        """The settings' policy, each duration given here replacing the
        setting's. Made once per set of values, settings included (read on
        every call, so a change to them is seen at once): every keyed request
        asks, and making one costs several times the lookup. Every value is
        keyed by its type too (``Decimal(5) == 5``, and a subclass may convert
        otherwise), so only equal values of one type share a policy (0.0 and
        -0.0, ``Decimal("5")`` and ``Decimal("5.00")``). The policy is made
        from the settings' values its key holds, not read again."""
        given = (ttl, lease, wait, *conf.values(_POLICY_SETTINGS))
        key = (*given, *map(type, given))
        try:
            policy = _POLICIES.get(key)
        except Exception:  # a value that cannot be a key (unhashable): made each time
            return cls._made(ttl, lease, wait, given[3:])
        if policy is not None:
            return policy
        policy = cls._made(ttl, lease, wait, given[3:])
        if len(_POLICIES) >= MAX_POLICIES:
            _POLICIES.clear()  # views choosing durations per request: start over
        _POLICIES[key] = policy
        return policy

    @classmethod
    def _made(
        cls, ttl: float | None, lease: float | None, wait: float | None, values: tuple[Any, ...]
    ) -> Policy:
        """The policy from the settings' ``values`` (``_POLICY_SETTINGS``, as
        given), read as ``conf`` reads them."""
        ttl_setting, lease_setting, wait_setting, using, marker = values
        policy = cls(
            ttl=to_seconds(ttl_setting) if ttl is None else ttl,
            lease=to_seconds(lease_setting) if lease is None else lease,
            wait=to_seconds(wait_setting) if wait is None else wait,
            using=str(using),
            marker=to_seconds(marker),
        )
        if ttl is not None or lease is not None or wait is not None:
            problems = policy_problems(policy.ttl, policy.lease, policy.wait)
            if problems:
                raise ImproperlyConfigured(
                    "Per-call idempotency options combined with the IDEMPOTENCY setting: "
                    + " ".join(problems)
                )
        return policy


# What Policy.from_settings reads, and the policies it made, by those values
# and its arguments.
_POLICY_SETTINGS = ("TTL", "LEASE", "WAIT_FOR_IN_FLIGHT", "DATABASE_ALIAS", "TRANSIENT_ERROR_TTL")
_POLICIES: dict[tuple[Any, ...], Policy] = {}
MAX_POLICIES = 64


@dataclass(frozen=True)
class Claim:
    """A key this worker owns: its work runs in ``transaction()``, and the
    claim is completed with the work or let go. The service API hands it out
    as ``Held``."""

    identity: Identity
    token: str
    policy: Policy
    # A validation error may have been answered for this key in the last
    # TRANSIENT_ERROR_TTL: worth asking the retry-storm guard, which is keyed
    # by the whole identity. True when the claim took over a live marker such
    # an error leaves, whatever body left it (a client alternating between
    # two bad bodies leaves the other's), and for every nested claim (a
    # nested release rolls back, marker included).
    guarded: bool = False
    # Made inside the caller's transaction: it commits or rolls back with it.
    nested: ClassVar[bool] = False

    @property
    def key(self) -> str:
        return self.identity.key

    @property
    def using(self) -> str:
        return self.policy.using

    def derive_key(self, label: str) -> str:
        """A stable key for a call to a downstream API made under this claim."""
        return derive_key(self.identity.scope, self.identity.key, label)

    def transaction(self) -> AbstractContextManager[Any]:
        """The transaction the work and its outcome commit in."""
        raise NotImplementedError

    def let_go(self, marker: float = 0) -> None:
        """Give the key up after the work ended without a stored outcome."""
        raise NotImplementedError

    def uncommitted(self) -> bool:
        """Whether the claim is still inside the transaction that made it,
        invisible to other workers (its lease then means nothing to them)."""
        return False


@dataclass(frozen=True)
class AtomicClaim(Claim):
    def transaction(self) -> AbstractContextManager[Any]:
        return UnitAtomic(self.using)

    def let_go(self, marker: float = 0) -> None:
        """A DELETE, or a marker row for ``marker`` seconds. If the database
        is what failed, the lease ending is the fallback, and the original
        error is what matters."""
        try:
            store.backend(self.using).release(self.identity, self.token, marker)
        except Error:
            logger.exception(
                "Could not release idempotency key %r; it frees when its lease ends", self.key
            )


@dataclass(frozen=True)
class NestedClaim(Claim):
    nested: ClassVar[bool] = True
    # The caller's outermost atomic block, to tell when it has ended.
    origin: Any = field(default=None, compare=False, repr=False)

    def transaction(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the savepoint units.claimed opened

    def let_go(self, marker: float = 0) -> None:
        pass  # the claim rolls back with the work's savepoint

    def uncommitted(self) -> bool:
        blocks = connections[self.using].atomic_blocks
        if self.origin is None:  # a transaction managed by hand
            return in_transaction(self.using)
        return bool(blocks) and blocks[0] is self.origin


@dataclass(frozen=True)
class Replay:
    """The key was completed before: its stored response."""

    response: StoredResponse


def in_transaction(using: str) -> bool:
    """Whether a transaction is open on ``using``; never touches the network,
    so it is safe to ask while the database is down."""
    return not runs_alone(connections[using])


def claim(identity: Identity, policy: Policy, connection: Any = None) -> Claim | Replay:
    """The key for this worker, or the response stored for it: from
    ``REPLAY_CACHE`` when it holds one (``remembered``), else from the
    database (``arbitrate``)."""
    cached = replays.get(identity, policy.using)
    if cached is not None:
        return remembered(identity, cached)
    return arbitrate(identity, policy, connection)


@signals.timed(signals.claim_timed)
def remembered(identity: Identity, response: StoredResponse) -> Replay:
    """A claim ``REPLAY_CACHE`` decided (``replays.get`` found ``response``):
    the database is not asked."""
    signals.replayed.send(Claim, identity=identity)
    return Replay(response)


@signals.timed(signals.claim_timed)
def arbitrate(identity: Identity, policy: Policy, connection: Any = None) -> Claim | Replay:
    """The key for this worker, or the response stored for it, as the
    database decides.

    Raises ``KeyInProgress`` while another worker holds it (after waiting up
    to ``policy.wait``), ``KeyReused`` when it was used for another request,
    ``OutcomeUnknown`` when its work was interrupted, ``StoreUnavailable``
    when the database cannot answer. ``connection``: this thread's
    connection to ``policy.using``, where the caller holds it already.

    A lock timeout or deadlock while claiming means another request holds the
    key's row inside a transaction: that is a 409, not an outage. Outside a
    transaction the failed statement left nothing behind, so it is retried
    like any duplicate in flight, within ``policy.wait``. A connection that
    broke since its last use (the database restarted) is replaced once.
    """
    store.backend(policy.using).check_storable(identity)
    deadline = time.monotonic() + policy.wait
    # One token for every attempt: a statement whose answer was lost with
    # its connection may have claimed the key, and the token recognises it.
    token = secrets.token_hex(16)
    reconnected = False
    while True:
        try:
            return _claim(identity, policy, deadline, token, connection)
        except Error as exc:
            nested = in_transaction(policy.using)
            if connections[policy.using].in_atomic_block:
                # The failed statement spoiled the enclosing savepoint.
                transaction.set_rollback(True, using=policy.using)
            if is_lock_conflict(exc):
                logger.info("Lock conflict claiming idempotency key %r: %s", identity.key, exc)
                # Inside a transaction, a deadlock may have rolled back more
                # than our statement: retrying there would build on lost work.
                if nested or time.monotonic() >= deadline:
                    signals.conflict.send(Claim, identity=identity)
                    raise KeyInProgress(identity.key) from exc
                time.sleep(POLL_INTERVAL)
                continue
            if (
                not nested
                and not reconnected
                and isinstance(exc, OperationalError | InterfaceError)
            ):
                reconnected = True
                with contextlib.suppress(Error):
                    connections[policy.using].close()
                continue
            logger.error("Idempotency claim failed for %r: %s", identity.key, exc)
            signals.store_unavailable.send(Claim, identity=identity)
            raise StoreUnavailable(str(exc)) from exc


def takeover(found: Existing, identity: Identity) -> str | None:
    """Why a new claim may replace the record it met, or None: a validation
    error's marker (anybody's, corrected or not), a record past its window
    (any request), or a claim whose worker is gone (the same request). An
    in-progress claim is judged by its lease alone: a per-view TTL shorter
    than the lease (or a renewed lease) must not let a duplicate take over
    work that is still running."""
    if found.released:
        return "marker"
    if found.expired and (found.status != store.IN_PROGRESS or found.lapsed):
        return "expired"
    if found.lapsed and found.status == store.IN_PROGRESS and found.matches(identity):
        return "lapsed"
    return None


def _claim(
    identity: Identity, policy: Policy, deadline: float, token: str, connection: Any
) -> Claim | Replay:
    records = store.backend(policy.using)
    if connection is None:
        connection = connections[policy.using]
    nested = not runs_alone(connection)
    blocks = connection.atomic_blocks
    read_since = replays.generation()
    origin = blocks[0] if nested and blocks else None

    def held(guarded: bool) -> Claim:
        if nested:
            return NestedClaim(identity, token, policy, guarded=True, origin=origin)
        return AtomicClaim(identity, token, policy, guarded=guarded)

    for _ in range(MAX_CLAIM_ATTEMPTS):
        found = records.claim(identity, token, policy.ttl, policy.lease, connection)
        while isinstance(found, Existing):
            if found.token == token:
                break  # our own INSERT or takeover, whose answer was lost
            reason = takeover(found, identity)
            if reason is not None:
                if not records.take_over(identity, found.token, token, policy.ttl, policy.lease):
                    found = None  # someone else replaced it first: claim again
                    break
                if reason == "lapsed":
                    logger.warning("Took over the lapsed claim on idempotency key %r", identity.key)
                    signals.takeover.send(Claim, identity=identity)
                return held(guarded=reason == "marker" and not found.expired)
            if not found.matches(identity):
                signals.mismatch.send(Claim, identity=identity)
                raise KeyReused(identity.key)
            if found.response is not None:
                signals.replayed.send(Claim, identity=identity)
                if not nested and not found.expiring:  # committed, and not about to expire
                    replays.put(identity, policy.using, found.response, read_since)
                return Replay(found.response)
            if found.interrupted:
                raise OutcomeUnknown(identity.key)
            if time.monotonic() >= deadline or connection.in_atomic_block:
                signals.conflict.send(Claim, identity=identity)
                raise KeyInProgress(identity.key)
            time.sleep(POLL_INTERVAL)
            found = records.fetch(identity, connection)
        if found is store.CLAIMED or isinstance(found, Existing):
            return held(guarded=False)
    signals.conflict.send(Claim, identity=identity)
    raise KeyInProgress(identity.key)
