"""Claim, complete, release and look up records, each in one round trip
(a claim that meets an existing record on MySQL or SQLite takes two).

Raw SQL on purpose: a claim must be a single INSERT that the unique
constraint arbitrates (never a read-then-write), and on PostgreSQL the
INSERT and the read of an existing record share one round trip.
Datetimes are compared inside SQL, so no backend's datetime parsing is
involved in a decision.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections

from idempotency_app.models import IdempotencyRecord

FORMAT_VERSION = 1
IN_PROGRESS = IdempotencyRecord.Status.IN_PROGRESS.value
COMPLETED = IdempotencyRecord.Status.COMPLETED.value


@dataclass(frozen=True)
class Identity:
    scope: str
    key: str
    operation: str
    fingerprint: str


@dataclass(frozen=True)
class StoredResponse:
    """What a completed record replays. ``body`` is None when it was too
    large (or streamed) to store: the status and headers still replay."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None

    def headers_json(self) -> str:
        return json.dumps([list(pair) for pair in self.headers], separators=(",", ":"))


def parse_headers(text: str | None) -> tuple[tuple[str, str], ...]:
    """The stored ``response_headers`` column: a JSON list of [name, value]."""
    return tuple((str(name), str(value)) for name, value in json.loads(text or "[]"))


@dataclass(frozen=True)
class Existing:
    """A record found at the key, with its state judged at one instant."""

    token: str
    operation: str
    fingerprint: str
    status: str
    expired: bool
    lapsed: bool
    response: StoredResponse | None

    def matches(self, identity: Identity) -> bool:
        return self.operation == identity.operation and self.fingerprint == identity.fingerprint


class Claimed:
    """The INSERT won: the caller owns the key."""


CLAIMED = Claimed()

_COLUMNS = (
    "scope",
    "key",
    "operation",
    "fingerprint",
    "status",
    "token",
    "created_at",
    "expires_at",
    "locked_until",
    "response_headers",
    "format_version",
)


@dataclass(frozen=True)
class _Statements:
    """Every statement for one database alias, built once with its vendor's quoting."""

    vendor: str
    claim: str
    select: str
    select_locking: str
    take_over: str
    complete: str
    release: str
    renew: str


@functools.cache
def _statements(using: str) -> _Statements:
    connection = connections[using]
    q = connection.ops.quote_name
    table = q(IdempotencyRecord._meta.db_table)
    columns = ", ".join(q(c) for c in _COLUMNS)
    placeholders = ", ".join(["%s"] * len(_COLUMNS))
    where_key = f"{q('scope')} = %s AND {q('key')} = %s"
    where_token = f"{where_key} AND {q('token')} = %s"
    existing = (
        f"{q('token')}, {q('operation')}, {q('fingerprint')}, {q('status')}, "
        f"{q('expires_at')} <= %s, {q('locked_until')} <= %s, "
        f"{q('response_status')}, {q('response_headers')}, {q('response_body')}"
    )
    select = f"SELECT {existing} FROM {table} WHERE {where_key}"
    on_conflict = f"ON CONFLICT ({q('scope')}, {q('key')}) DO NOTHING"
    if connection.vendor == "postgresql":
        # The INSERT and the read of the record it collided with, in one round
        # trip. NOT EXISTS keeps replays from drawing a sequence value (and
        # from forcing a WAL flush every 32 of them); ON CONFLICT still
        # arbitrates two fresh claims racing.
        claim = (
            f"WITH ins AS (INSERT INTO {table} ({columns}) SELECT {placeholders} "
            f"WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE {where_key}) "
            f"{on_conflict} RETURNING 1) "
            f"SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM ins "
            f"UNION ALL {select}"
        )
    elif connection.vendor == "mysql":
        claim = f"INSERT IGNORE INTO {table} ({columns}) VALUES ({placeholders})"
    else:
        claim = f"INSERT INTO {table} ({columns}) VALUES ({placeholders}) {on_conflict}"
    assignments = ", ".join(f"{q(c)} = %s" for c in _COLUMNS[2:])
    return _Statements(
        vendor=connection.vendor,
        claim=claim,
        select=select,
        # A consistent read inside a MySQL transaction uses its old snapshot
        # and would miss a row committed since; a locking read sees it.
        select_locking=select + " LOCK IN SHARE MODE",
        # The token alone is not enough: the owner keeps its token when it
        # completes or renews, so the state that allowed the takeover is
        # checked again in the same statement.
        take_over=(
            f"UPDATE {table} SET {assignments}, {q('response_status')} = NULL, "
            f"{q('response_body')} = NULL WHERE {where_token} AND ("
            f"({q('status')} = %s AND {q('expires_at')} <= %s) OR "
            f"({q('status')} = %s AND {q('locked_until')} <= %s))"
        ),
        complete=(
            f"UPDATE {table} SET {q('status')} = %s, {q('expires_at')} = %s, "
            f"{q('locked_until')} = NULL, {q('response_status')} = %s, "
            f"{q('response_headers')} = %s, {q('response_body')} = %s WHERE {where_token}"
        ),
        # Only an unfinished claim: a stored outcome is never deleted by its owner.
        release=f"DELETE FROM {table} WHERE {where_token} AND {q('status')} = %s",
        renew=(
            f"UPDATE {table} SET {q('locked_until')} = %s "
            f"WHERE {where_token} AND {q('status')} = %s"
        ),
    )


def _dt(using: str, value: datetime) -> Any:
    return connections[using].ops.adapt_datetimefield_value(value)


def _row_values(
    identity: Identity, token: str, now: datetime, ttl: float, lease: float, using: str
) -> list[Any]:
    return [
        identity.scope,
        identity.key,
        identity.operation,
        identity.fingerprint,
        IN_PROGRESS,
        token,
        _dt(using, now),
        _dt(using, now + timedelta(seconds=ttl)),
        _dt(using, now + timedelta(seconds=lease)),
        "",
        FORMAT_VERSION,
    ]


def _existing(row: tuple[Any, ...]) -> Existing:
    token, operation, fingerprint, status, expired, lapsed, resp_status, resp_headers, resp_body = (
        row
    )
    response = None
    if status == COMPLETED and resp_status is not None:
        headers = parse_headers(resp_headers)
        body = None if resp_body is None else bytes(resp_body)
        response = StoredResponse(int(resp_status), headers, body)
    return Existing(token, operation, fingerprint, status, bool(expired), bool(lapsed), response)


def _execute(using: str, sql: str, params: list[Any]) -> Any:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount, cursor.fetchone() if cursor.description else None


def insert_or_fetch(
    identity: Identity, token: str, now: datetime, ttl: float, lease: float, using: str
) -> Existing | Claimed | None:
    """Claim the key with ``token``.

    Returns CLAIMED, or the record that holds the key, or None when that
    record was released between our INSERT and our read (try again).
    """
    sql = _statements(using)
    values = _row_values(identity, token, now, ttl, lease, using)
    if sql.vendor == "postgresql":
        stamp = _dt(using, now)
        _, row = _execute(
            using,
            sql.claim,
            [*values, identity.scope, identity.key, stamp, stamp, identity.scope, identity.key],
        )
        if row is None:
            # Lost the race to a row this statement's snapshot cannot see yet.
            return fetch(identity, now, using)
        return CLAIMED if row[0] is None else _existing(row)
    rowcount, _ = _execute(using, sql.claim, values)
    return CLAIMED if rowcount == 1 else fetch(identity, now, using)


def fetch(identity: Identity, now: datetime, using: str) -> Existing | None:
    sql = _statements(using)
    locking = sql.vendor == "mysql" and connections[using].in_atomic_block
    stamp = _dt(using, now)
    _, row = _execute(
        using,
        sql.select_locking if locking else sql.select,
        [stamp, stamp, identity.scope, identity.key],
    )
    return None if row is None else _existing(row)


def take_over(
    identity: Identity,
    old_token: str,
    token: str,
    now: datetime,
    ttl: float,
    lease: float,
    using: str,
) -> bool:
    """Replace an expired record or a lapsed claim; a compare-and-set on the
    old token, so of two workers taking over at once only one wins."""
    values = _row_values(identity, token, now, ttl, lease, using)
    stamp = _dt(using, now)
    rowcount, _ = _execute(
        using,
        _statements(using).take_over,
        [
            *values[2:],
            identity.scope,
            identity.key,
            old_token,
            COMPLETED,
            stamp,
            IN_PROGRESS,
            stamp,
        ],
    )
    return bool(rowcount == 1)


def complete(
    identity: Identity,
    token: str,
    response: StoredResponse,
    now: datetime,
    ttl: float,
    using: str,
) -> bool:
    """Mark the claim completed; False when ``token`` no longer owns it."""
    rowcount, _ = _execute(
        using,
        _statements(using).complete,
        [
            COMPLETED,
            _dt(using, now + timedelta(seconds=ttl)),
            response.status,
            response.headers_json(),
            response.body,
            identity.scope,
            identity.key,
            token,
        ],
    )
    return bool(rowcount == 1)


def release(identity: Identity, token: str, using: str) -> bool:
    """Delete the claim so a retry runs again; False when it was not ours."""
    rowcount, _ = _execute(
        using, _statements(using).release, [identity.scope, identity.key, token, IN_PROGRESS]
    )
    return bool(rowcount == 1)


def renew(identity: Identity, token: str, now: datetime, lease: float, using: str) -> bool:
    """Extend the lease of a claim still held by ``token``."""
    rowcount, _ = _execute(
        using,
        _statements(using).renew,
        [
            _dt(using, now + timedelta(seconds=lease)),
            identity.scope,
            identity.key,
            token,
            IN_PROGRESS,
        ],
    )
    return bool(rowcount == 1)
