"""Claim, complete, release and renew records, each in one statement (a
claim that meets an existing record on MySQL or SQLite takes two).

Raw SQL on purpose: a claim must be a single INSERT that the unique
constraint arbitrates (never a read-then-write), and on PostgreSQL the
INSERT and the read of an existing record share one round trip. Every
instant is computed and compared inside the statement with the database's
clock (``clock.sql``): no app server's clock takes part in a decision.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, connections

from idempotency_app import clock
from idempotency_app.exceptions import UnstorableIdentity
from idempotency_app.models import IdempotencyRecord

FORMAT_VERSION = 1
IN_PROGRESS = IdempotencyRecord.Status.IN_PROGRESS.value
COMPLETED = IdempotencyRecord.Status.COMPLETED.value
RELEASED = IdempotencyRecord.Status.RELEASED.value
INTERRUPTED = IdempotencyRecord.Status.INTERRUPTED.value
# What an interrupted record says it answered: the client got a 500.
INTERRUPTED_STATUS = 500
# MySQL's duplicate-key error: the one error a claim's INSERT expects.
MYSQL_DUPLICATE_KEY = 1062


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

    @property
    def released(self) -> bool:
        return self.status == RELEASED

    @property
    def interrupted(self) -> bool:
        return self.status == INTERRUPTED


class Claimed:
    """The INSERT won: the caller owns the key."""


CLAIMED = Claimed()


@dataclass(frozen=True)
class _Statements:
    """Every statement for one database alias, built once with its vendor's
    quoting. Each ``{now}``-style instant takes one parameter: seconds from
    the database's now (``clock.param``)."""

    vendor: str
    # MySQL through a connection that is not utf8mb4 turns characters
    # outside the Basic Multilingual Plane into "?": two keys would collide.
    narrow_charset: bool
    claim: str
    # The claim outside any transaction. PostgreSQL: its commit does not wait
    # for its WAL flush. MariaDB: it returns the row it met (one round trip).
    claim_async: str
    select: str
    select_locking: str
    take_over: str
    complete: str
    release: str
    release_marked: str
    interrupt: str
    renew: str


@functools.cache
def _statements(using: str) -> _Statements:
    connection = connections[using]
    vendor = connection.vendor
    q = connection.ops.quote_name
    now = clock.sql(vendor)
    table = q(IdempotencyRecord._meta.db_table)
    scope, key, token, status = q("scope"), q("key"), q("token"), q("status")
    where_key = f"{scope} = %s AND {key} = %s"
    where_token = f"{where_key} AND {token} = %s"
    in_progress = f"{status} = '{IN_PROGRESS}'"
    columns = ", ".join(
        q(c)
        for c in (
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
    )
    # scope, key, operation, fingerprint, token; then now, now + TTL, now + lease.
    values = f"%s, %s, %s, %s, '{IN_PROGRESS}', %s, {now}, {now}, {now}, '', {FORMAT_VERSION}"
    existing = (
        f"{token}, {q('operation')}, {q('fingerprint')}, {status}, "
        f"{q('expires_at')} <= {now}, {q('locked_until')} <= {now}, "
        f"{q('response_status')}, {q('response_headers')}, {q('response_body')}"
    )
    select = f"SELECT {existing} FROM {table} WHERE {where_key}"
    on_conflict = f"ON CONFLICT ({scope}, {key}) DO NOTHING"
    if vendor == "postgresql":
        # The INSERT and the read of the record it collided with, in one round
        # trip. NOT EXISTS keeps replays from drawing a sequence value (and
        # from forcing a WAL flush every 32 of them); ON CONFLICT still
        # arbitrates two fresh claims racing.
        def postgres_claim(cfg: str = "", join: str = "") -> str:
            return (
                f"WITH ins AS (INSERT INTO {table} ({columns}) SELECT {values} "
                f"WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE {where_key}) "
                f"{on_conflict} RETURNING 1){cfg} "
                f"SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM ins{join} "
                f"UNION ALL {select}"
            )

        claim = postgres_claim()
        # WAL is flushed in order, so the work's own (synchronous) commit
        # makes the claim durable too; a crash can only lose a claim whose
        # work never committed, which a retry then runs. Never inside a
        # transaction, where it would make the caller's commit asynchronous.
        claim_async = postgres_claim(
            ", cfg AS (SELECT set_config('synchronous_commit', 'off', true))", " CROSS JOIN cfg"
        )
    elif vendor == "mysql":
        # A plain INSERT whose duplicate-key error is caught: INSERT IGNORE
        # would also turn data errors into warnings and claim a mangled key.
        claim = f"INSERT INTO {table} ({columns}) VALUES ({values})"
        # MariaDB 10.5+ returns the row an ON DUPLICATE KEY UPDATE met: the
        # claim and the read of a taken key in one round trip. Outside a
        # transaction only: the no-op update write-locks the existing row,
        # which a transaction would hold (and serialise replays) until it ends.
        claim_async = f"{claim} ON DUPLICATE KEY UPDATE {q('id')} = {q('id')} RETURNING {existing}"
    else:
        claim = f"INSERT INTO {table} ({columns}) VALUES ({values}) {on_conflict}"
        claim_async = claim
    return _Statements(
        vendor=vendor,
        narrow_charset=vendor == "mysql"
        and narrow_mysql_charset(connection.settings_dict) is not None,
        claim=claim,
        claim_async=claim_async,
        select=select,
        # A consistent read inside a MySQL transaction uses its old snapshot
        # and would miss a row committed since; a locking read sees it.
        select_locking=select + " LOCK IN SHARE MODE",
        # The token alone is not enough: the owner keeps its token when it
        # completes or renews, so the state that allowed the takeover is
        # checked again in the same statement.
        take_over=(
            f"UPDATE {table} SET {q('operation')} = %s, {q('fingerprint')} = %s, "
            f"{status} = '{IN_PROGRESS}', {token} = %s, {q('created_at')} = {now}, "
            f"{q('expires_at')} = {now}, {q('locked_until')} = {now}, "
            f"{q('response_status')} = NULL, {q('response_headers')} = '', "
            f"{q('response_body')} = NULL, {q('format_version')} = {FORMAT_VERSION} "
            f"WHERE {where_token} AND ("
            f"({status} IN ('{COMPLETED}', '{INTERRUPTED}') AND {q('expires_at')} <= {now}) OR "
            f"({in_progress} AND {q('locked_until')} <= {now}) OR "
            f"{status} = '{RELEASED}')"
        ),
        # Only an unfinished claim completes: a second completion must never
        # overwrite a result that duplicates may already have read.
        complete=(
            f"UPDATE {table} SET {status} = '{COMPLETED}', {q('expires_at')} = {now}, "
            f"{q('locked_until')} = NULL, {q('response_status')} = %s, "
            f"{q('response_headers')} = %s, {q('response_body')} = %s "
            f"WHERE {where_token} AND {in_progress}"
        ),
        # Only an unfinished claim: a stored outcome is never deleted by its owner.
        release=f"DELETE FROM {table} WHERE {where_token} AND {in_progress}",
        # The same, leaving a marker that the next claim of the key meets for
        # free, so that only a retry after a validation error reads the guard.
        release_marked=(
            f"UPDATE {table} SET {status} = '{RELEASED}', {q('expires_at')} = {now}, "
            f"{q('locked_until')} = NULL WHERE {where_token} AND {in_progress}"
        ),
        # Work that ended its own transaction: its claim answers so for TTL.
        interrupt=(
            f"UPDATE {table} SET {status} = '{INTERRUPTED}', {q('expires_at')} = {now}, "
            f"{q('locked_until')} = NULL, {q('response_status')} = {INTERRUPTED_STATUS} "
            f"WHERE {where_token} AND {in_progress}"
        ),
        renew=(
            f"UPDATE {table} SET {q('locked_until')} = {now} WHERE {where_token} AND {in_progress}"
        ),
    )


def narrow_mysql_charset(settings_dict: dict[str, Any]) -> str | None:
    """The connection character set a MySQL database entry asks for, when it
    is not utf8mb4 (Django's default is utf8, which is utf8mb3)."""
    charset = str(dict(settings_dict.get("OPTIONS") or {}).get("charset", "utf8")).lower()
    return None if charset == "utf8mb4" else charset


def vendor(using: str) -> str:
    return _statements(using).vendor


def check_storable(identity: Identity, using: str) -> None:
    """Refuse, before any query, what the connection would store mangled."""
    if _statements(using).narrow_charset and any(
        ord(ch) > 0xFFFF for ch in identity.scope + identity.key + identity.operation
    ):
        raise UnstorableIdentity(
            f"The idempotency scope, key or operation of {identity.key!r} holds characters "
            f"outside the Basic Multilingual Plane, which the connection to database {using!r} "
            'cannot store: set DATABASES[...]["OPTIONS"] = {"charset": "utf8mb4"}.'
        )


def _execute(using: str, sql: str, params: list[Any], connection: Any = None) -> tuple[int, Any]:
    with (connection or connections[using]).cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount, cursor.fetchone() if cursor.description else None


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


def insert_or_fetch(
    identity: Identity, token: str, ttl: float, lease: float, using: str
) -> Existing | Claimed | None:
    """Claim the key with ``token``.

    Returns CLAIMED, or the record that holds the key, or None when that
    record was released between our INSERT and our read (try again).
    """
    sql = _statements(using)
    v = sql.vendor
    stamp = clock.param(v, 0)
    values = [
        identity.scope,
        identity.key,
        identity.operation,
        identity.fingerprint,
        token,
        stamp,
        clock.param(v, ttl),
        clock.param(v, lease),
    ]
    alone = _runs_alone(connections[using])
    if v == "postgresql":
        _, row = _execute(
            using,
            sql.claim_async if alone else sql.claim,
            [*values, identity.scope, identity.key, stamp, stamp, identity.scope, identity.key],
        )
        if row is None:
            # Lost the race to a row this statement's snapshot cannot see yet.
            return fetch(identity, using)
        return CLAIMED if row[0] is None else _existing(row)
    if v == "mysql":
        if alone and _returning(using):
            _, row = _execute(using, sql.claim_async, [*values, stamp, stamp])
            return CLAIMED if row[0] == token else _existing(row)
        try:
            _execute(using, sql.claim, values)
        except IntegrityError as exc:
            cause = exc.__cause__
            if not (cause is not None and cause.args and cause.args[0] == MYSQL_DUPLICATE_KEY):
                raise
            return fetch(identity, using)
        return CLAIMED
    rowcount, _ = _execute(using, sql.claim, values)
    return CLAIMED if rowcount == 1 else fetch(identity, using)


def _runs_alone(connection: Any) -> bool:
    """Whether a statement sent now is a transaction of its own. A
    connection not opened yet (the first query of a request under the
    default CONN_MAX_AGE = 0) reports autocommit off until it connects: its
    settings say what it will be."""
    if connection.in_atomic_block:
        return False
    if connection.connection is None:
        return bool(connection.settings_dict.get("AUTOCOMMIT", True))
    return bool(connection.autocommit)


@functools.cache
def _returning(using: str) -> bool:
    """Whether the server is MariaDB 10.5 or newer (asked once per process)."""
    connection: Any = connections[using]  # the MySQL backend's wrapper
    return bool(connection.mysql_is_mariadb and connection.mysql_version >= (10, 5))


def fetch(identity: Identity, using: str) -> Existing | None:
    sql = _statements(using)
    locking = sql.vendor == "mysql" and connections[using].in_atomic_block
    stamp = clock.param(sql.vendor, 0)
    _, row = _execute(
        using,
        sql.select_locking if locking else sql.select,
        [stamp, stamp, identity.scope, identity.key],
    )
    return None if row is None else _existing(row)


def take_over(
    identity: Identity, old_token: str, token: str, ttl: float, lease: float, using: str
) -> bool:
    """Replace an expired record or a lapsed claim; a compare-and-set on the
    old token, so of two workers taking over at once only one wins."""
    v = vendor(using)
    stamp = clock.param(v, 0)
    rowcount, _ = _execute(
        using,
        _statements(using).take_over,
        [
            identity.operation,
            identity.fingerprint,
            token,
            stamp,
            clock.param(v, ttl),
            clock.param(v, lease),
            identity.scope,
            identity.key,
            old_token,
            stamp,
            stamp,
        ],
    )
    return rowcount == 1


def complete(
    identity: Identity, token: str, response: StoredResponse, ttl: float, using: str
) -> bool:
    """Mark the claim completed; False when ``token`` no longer holds it."""
    rowcount, _ = _execute(
        using,
        _statements(using).complete,
        [
            clock.param(vendor(using), ttl),
            response.status,
            response.headers_json(),
            response.body,
            identity.scope,
            identity.key,
            token,
        ],
    )
    return rowcount == 1


def release(identity: Identity, token: str, using: str, marker: float = 0) -> bool:
    """Give up the claim so a retry runs again; False when it was not ours.
    With ``marker`` seconds, a marker row stays that long instead."""
    sql = _statements(using)
    if marker > 0:
        rowcount, _ = _execute(
            using,
            sql.release_marked,
            [clock.param(sql.vendor, marker), identity.scope, identity.key, token],
        )
    else:
        rowcount, _ = _execute(using, sql.release, [identity.scope, identity.key, token])
    return rowcount == 1


def interrupt(identity: Identity, token: str, ttl: float, using: str) -> bool:
    """Mark the claim interrupted, on a connection of its own: the work's
    connection is inside a transaction that no longer is the work's. False
    when the claim is not there (its transaction rolled back) or not ours."""
    side = connections.create_connection(using)
    try:
        rowcount, _ = _execute(
            using,
            _statements(using).interrupt,
            [clock.param(vendor(using), ttl), identity.scope, identity.key, token],
            side,
        )
    finally:
        side.close()
    return rowcount == 1


def isolation_level(using: str) -> str:
    """The PostgreSQL transaction's isolation level, as ``SHOW`` names it."""
    _, row = _execute(using, "SHOW transaction_isolation", [])
    return str(row[0])


def renew(identity: Identity, token: str, lease: float, using: str, connection: Any = None) -> bool:
    """Extend the lease of a claim still held by ``token`` (through
    ``connection``, another connection to ``using``, when given)."""
    rowcount, _ = _execute(
        using,
        _statements(using).renew,
        [clock.param(vendor(using), lease), identity.scope, identity.key, token],
        connection,
    )
    return rowcount == 1
