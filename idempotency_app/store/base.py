"""What the store reads and writes, and what every database's store shares.

Raw SQL on purpose: a claim must be a single INSERT that the unique
constraint arbitrates (never a read-then-write), the other writes are each
one statement whose condition is judged where it runs, and every instant is
computed and compared inside the statement with the database's clock
(``clock.sql``): no app server's clock takes part in a decision. Statements
are built once per database alias with its vendor's quoting, and take named
parameters.

A vendor module (``postgresql``, ``mysql``, ``sqlite``) subclasses
``Backend`` for what its database does its own way: the claim.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import orjson
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from idempotency_app import clock
from idempotency_app.conf import MAX_REPLAY_CACHE
from idempotency_app.exceptions import UnstorableIdentity
from idempotency_app.models import IdempotencyRecord

FORMAT_VERSION = 1
IN_PROGRESS = IdempotencyRecord.Status.IN_PROGRESS.value
COMPLETED = IdempotencyRecord.Status.COMPLETED.value
RELEASED = IdempotencyRecord.Status.RELEASED.value
INTERRUPTED = IdempotencyRecord.Status.INTERRUPTED.value
# What an interrupted record says it answered: the client got a 500.
INTERRUPTED_STATUS = 500


@dataclass(frozen=True)
class Identity:
    """What a record is keyed by (scope, key) and judged by (operation,
    fingerprint)."""

    scope: str
    key: str
    operation: str
    fingerprint: str


@dataclass(frozen=True)
class StoredResponse:
    """What a completed record holds: a view's response (its status,
    allow-listed headers and body; ``body`` is None when it was too large,
    or streamed, to store: the status and headers still replay), or a task's
    result, whose ``status`` is None and whose body is JSON."""

    status: int | None
    headers: tuple[tuple[str, str], ...]
    body: bytes | None

    def headers_json(self) -> str:
        """The ``response_headers`` column: a JSON list of [name, value] in
        ASCII, as the standard library writes it. orjson writes the same
        text at about half the cost where the pairs are of ``str`` and its
        text is ASCII without DEL (which only the standard library escapes):
        a response's headers nearly always are (Django allows Latin-1 and DEL
        in their values). The rest the standard library writes."""
        pairs = [list(pair) for pair in self.headers]  # as the standard library is given them
        if _text_pairs(pairs):
            try:
                written = orjson.dumps(pairs)
            except TypeError:  # a lone surrogate, which orjson refuses
                return _write_headers(pairs)
            if written.isascii() and b"\x7f" not in written:
                return written.decode()
        return _write_headers(pairs)


def _text_pairs(pairs: Any) -> bool:
    """Whether ``pairs`` is a list of [name, value] lists of ``str`` itself:
    what orjson writes and reads as the standard library does (it writes a
    UUID or a datetime, which the standard library refuses)."""
    return type(pairs) is list and all(
        type(pair) is list and len(pair) == 2 and type(pair[0]) is str is type(pair[1])
        for pair in pairs
    )


# json.dumps() builds an encoder per call when given options: this one is built once.
_write_headers = json.JSONEncoder(separators=(",", ":")).encode


def parse_headers(text: str | None) -> tuple[tuple[str, str], ...]:
    """The stored ``response_headers`` column: a JSON list of [name, value].
    Read by orjson where every name and value is text (as the library
    writes them); anything else by the standard library, as it always was
    (orjson reads a large integer as a float, and refuses an escaped lone
    surrogate)."""
    try:
        pairs = orjson.loads(text or "[]")
    except (ValueError, TypeError):  # orjson's JSONDecodeError, or not text
        pairs = None
    if _text_pairs(pairs):
        return tuple(map(tuple, pairs))
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
    # Expires within MAX_REPLAY_CACHE seconds: never held in memory.
    expiring: bool = True

    def matches(self, identity: Identity) -> bool:
        return self.operation == identity.operation and self.fingerprint == identity.fingerprint

    @property
    def released(self) -> bool:
        return self.status == RELEASED

    @property
    def interrupted(self) -> bool:
        return self.status == INTERRUPTED

    @property
    def replaceable(self) -> bool:
        """Whether a new claim may take the record over: a validation
        error's marker, a record past its window, or a claim whose lease
        lapsed. An in-progress claim is judged by its lease alone: a per-view
        TTL shorter than the lease (or a renewed lease) must not let a
        duplicate take over work that is still running."""
        if self.status == IN_PROGRESS:
            return self.lapsed
        return self.released or self.expired


class Claimed:
    """The INSERT won: the caller owns the key."""


CLAIMED = Claimed()

# The record's columns, as the claim's INSERT writes them.
CLAIM_COLUMNS = (
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


class Backend:
    """The records' store on one database alias. Holds statements, never a
    connection: each call uses the calling thread's connection."""

    vendor = ""

    def __init__(self, using: str) -> None:
        connection = connections[using]
        self.using = using
        q = self.quote = connection.ops.quote_name
        self.table = q(IdempotencyRecord._meta.db_table)
        now, status, token = self.now(), q("status"), q("token")
        where_key = f"{q('scope')} = %(scope)s AND {q('key')} = %(key)s"
        where_token = f"{where_key} AND {token} = %(token)s"
        in_progress = f"{status} = '{IN_PROGRESS}'"
        self.where_key = where_key
        # What a claim that meets a record reads: its state judged by the
        # database's clock, and its stored response.
        self.existing_columns = (
            f"{token}, {q('operation')}, {q('fingerprint')}, {status}, "
            f"{q('expires_at')} <= {now}, {q('locked_until')} <= {now}, "
            f"{q('response_status')}, {q('response_headers')}, {q('response_body')}, "
            f"{q('expires_at')} <= {self.now('soon')}"
        )
        # The claim's INSERT, and the values it writes (VALUES or SELECT them).
        self.insert_into = f"INSERT INTO {self.table} ({', '.join(q(c) for c in CLAIM_COLUMNS)})"
        self.claim_values = (
            f"%(scope)s, %(key)s, %(operation)s, %(fingerprint)s, '{IN_PROGRESS}', %(token)s, "
            f"{now}, {self.now('expires')}, {self.now('lease')}, '', {FORMAT_VERSION}"
        )
        self.select = f"SELECT {self.existing_columns} FROM {self.table} WHERE {where_key}"
        # The token alone is not enough: the owner keeps its token when it
        # completes or renews, so the state that allowed the takeover is
        # checked again in the same statement.
        self.take_over_sql = (
            f"UPDATE {self.table} SET {q('operation')} = %(operation)s, "
            f"{q('fingerprint')} = %(fingerprint)s, {status} = '{IN_PROGRESS}', "
            f"{token} = %(new_token)s, {q('created_at')} = {now}, "
            f"{q('expires_at')} = {self.now('expires')}, "
            f"{q('locked_until')} = {self.now('lease')}, "
            f"{q('response_status')} = NULL, {q('response_headers')} = '', "
            f"{q('response_body')} = NULL, {q('format_version')} = {FORMAT_VERSION} "
            f"WHERE {where_token} AND ("
            f"({status} IN ('{COMPLETED}', '{INTERRUPTED}') AND {q('expires_at')} <= {now}) OR "
            f"({in_progress} AND {q('locked_until')} <= {now}) OR "
            f"{status} = '{RELEASED}')"
        )
        # Only an unfinished claim completes: a second completion must never
        # overwrite a result that duplicates may already have read.
        self.complete_sql = (
            f"UPDATE {self.table} SET {status} = '{COMPLETED}', "
            f"{q('expires_at')} = {self.now('expires')}, {q('locked_until')} = NULL, "
            f"{q('response_status')} = %(status)s, {q('response_headers')} = %(headers)s, "
            f"{q('response_body')} = %(body)s WHERE {where_token} AND {in_progress}"
        )
        # Only an unfinished claim: a stored outcome is never deleted by its owner.
        self.release_sql = f"DELETE FROM {self.table} WHERE {where_token} AND {in_progress}"
        # The same, leaving a marker that the next claim of the key meets for
        # free, so that only a retry after a validation error reads the guard.
        self.release_marked_sql = (
            f"UPDATE {self.table} SET {status} = '{RELEASED}', "
            f"{q('expires_at')} = {self.now('expires')}, {q('locked_until')} = NULL "
            f"WHERE {where_token} AND {in_progress}"
        )
        # Work that ended its own transaction: its claim answers so for TTL.
        self.interrupt_sql = (
            f"UPDATE {self.table} SET {status} = '{INTERRUPTED}', "
            f"{q('expires_at')} = {self.now('expires')}, {q('locked_until')} = NULL, "
            f"{q('response_status')} = {INTERRUPTED_STATUS} "
            f"WHERE {where_token} AND {in_progress}"
        )
        self.renew_sql = (
            f"UPDATE {self.table} SET {q('locked_until')} = {self.now('lease')} "
            f"WHERE {where_token} AND {in_progress}"
        )
        # What the sweep deletes: records past their window and not held by
        # a live lease (renewed beyond its expiry), and in-progress claims
        # inside their window whose lease lapsed ``grace`` seconds ago.
        self.sweep_conditions = {
            "expired": (
                f"{q('expires_at')} <= {now} AND "
                f"({q('locked_until')} IS NULL OR {q('locked_until')} <= {now})"
            ),
            "stale": (
                f"{in_progress} AND {q('locked_until')} <= {self.now('stale_before')} "
                f"AND {q('expires_at')} > {now}"
            ),
        }
        self.releasable = f"{status} IN ('{IN_PROGRESS}', '{INTERRUPTED}')"

    def now(self, name: str = "now") -> str:
        """The database's clock plus the seconds of parameter ``name``."""
        return clock.sql(self.vendor, name)

    def params(self, identity: Identity, **seconds: float) -> dict[str, Any]:
        """The key's parameters, and each instant as seconds from the
        database's now (``now`` itself always)."""
        offsets = {name: clock.param(self.vendor, value) for name, value in seconds.items()}
        return {
            "scope": identity.scope,
            "key": identity.key,
            "now": clock.param(self.vendor, 0),
            **offsets,
        }

    def execute(
        self, sql: str, params: Mapping[str, Any] | None, connection: Any = None
    ) -> tuple[int, Any]:
        """The rows the statement touched, and its first row if it returns any."""
        connection = connection or connections[self.using]
        cursor = statement_cursor(connection)
        self.adapt(cursor.cursor)
        with self.sending(connection):
            cursor.execute(sql, params)
        return cursor.rowcount, cursor.fetchone() if cursor.description else None

    def adapt(self, cursor: Any) -> None:
        """Ready the driver's ``cursor`` for the store's statements."""

    def sending(self, connection: Any) -> AbstractContextManager[Any]:
        """Around a statement whose result is read at once."""
        return contextlib.nullcontext()

    # -- the lifecycle -----------------------------------------------------

    def check_storable(self, identity: Identity) -> None:
        """Refuse, before any query, what the connection would store mangled."""

    def claim(
        self, identity: Identity, token: str, ttl: float, lease: float, connection: Any = None
    ) -> Existing | Claimed | None:
        """Claim the key with ``token``: CLAIMED, or the record that holds
        the key, or None when that record was released between our INSERT
        and our read (try again). ``connection``: this thread's connection
        to ``using`` where the caller holds it already (as here and in
        ``complete``; looking it up costs as much Python as a short
        statement)."""
        raise NotImplementedError

    def claim_params(
        self, identity: Identity, token: str, ttl: float, lease: float
    ) -> dict[str, Any]:
        return {
            **self.params(identity, expires=ttl, lease=lease, soon=MAX_REPLAY_CACHE),
            "operation": identity.operation,
            "fingerprint": identity.fingerprint,
            "token": token,
        }

    def fetch(self, identity: Identity, connection: Any = None) -> Existing | None:
        """The record at the key as ``connection`` (the claim's) sees it."""
        params = self.params(identity, soon=MAX_REPLAY_CACHE)
        _, row = self.execute(self.select, params, connection)
        return None if row is None else self.found(row, connection)

    def found(self, row: Sequence[Any], connection: Any = None) -> Existing:
        """The record a statement read on ``connection`` (this thread's to
        ``using`` when None). A large result (its stored body and headers,
        as read) is not left held by that connection's kept cursor
        (``let_go_of_large_results``)."""
        record = existing(row)
        if is_large(row[7], row[8]):
            let_go_of_large_results(connection or connections[self.using])
        return record

    def take_over(
        self, identity: Identity, old_token: str, token: str, ttl: float, lease: float
    ) -> bool:
        """Replace an expired record, a lapsed claim or a marker; a
        compare-and-set on the old token, so of two workers taking over at
        once only one wins."""
        params = self.claim_params(identity, old_token, ttl, lease)
        rowcount, _ = self.execute(self.take_over_sql, {**params, "new_token": token})
        return rowcount == 1

    def complete(
        self,
        identity: Identity,
        token: str,
        response: StoredResponse,
        ttl: float,
        commit: bool = False,
        before: Sequence[str] = (),
        connection: Any = None,
    ) -> bool:
        """Mark the claim completed; False when ``token`` no longer holds it.
        ``commit``: the caller's transaction commits next, and the backend
        may send the COMMIT with the completion (then False means it rolled
        back instead, and an error that it may have committed or not).
        ``before``: statements of the transaction to send first, in the same
        message; given only where ``carries_statements()``."""
        assert not before, "only a backend that carries statements takes them"
        params = self.complete_params(identity, token, response, ttl)
        rowcount, _ = self.execute(self.complete_sql, params, connection)
        if is_large(params["headers"], params["body"]):  # held in the statement's text
            let_go_of_large_results(connection or connections[self.using])
        return rowcount == 1

    def carries_statements(self, connection: Any = None) -> bool:
        """Whether ``complete()`` can send other statements in front of the
        completion, in the same message (and the COMMIT after it)."""
        return False

    def complete_params(
        self, identity: Identity, token: str, response: StoredResponse, ttl: float
    ) -> dict[str, Any]:
        return {
            **self.params(identity, expires=ttl),
            "token": token,
            "status": response.status,
            "headers": response.headers_json(),
            "body": response.body,
        }

    def release(self, identity: Identity, token: str, marker: float = 0) -> bool:
        """Give up the claim so a retry runs again; False when it was not ours.
        With ``marker`` seconds, a marker row stays that long instead."""
        if marker > 0:
            params = {**self.params(identity, expires=marker), "token": token}
            rowcount, _ = self.execute(self.release_marked_sql, params)
        else:
            rowcount, _ = self.execute(self.release_sql, {**self.params(identity), "token": token})
        return rowcount == 1

    def interrupt(self, identity: Identity, token: str, ttl: float) -> bool:
        """Mark the claim interrupted, on a connection of its own: the work's
        connection is inside a transaction that no longer is the work's. False
        when the claim is not there (its transaction rolled back) or not ours."""
        side = connections.create_connection(self.using)
        try:
            params = {**self.params(identity, expires=ttl), "token": token}
            rowcount, _ = self.execute(self.interrupt_sql, params, side)
        finally:
            side.close()
        return rowcount == 1

    def renew(self, identity: Identity, token: str, lease: float, connection: Any = None) -> bool:
        """Extend the lease of a claim still held by ``token`` (through
        ``connection``, another connection to the alias, when given)."""
        params = {**self.params(identity, lease=lease), "token": token}
        rowcount, _ = self.execute(self.renew_sql, params, connection)
        return rowcount == 1

    def renews_in_place(self) -> bool:
        """Whether, inside the work's transaction, ``renew`` must go through
        that transaction (which then holds the row: duplicates and the sweep
        wait at it until the work ends, and a lock_timeout turns that wait
        into a 409) rather than through a connection of its own, whose new
        lease other workers see at once."""
        return False

    # -- the sweep and the admin -------------------------------------------

    def sweep_batch(self, kind: str, after: int | None, size: int, grace: float = 0) -> list[int]:
        """Up to ``size`` primary keys of ``kind`` ("expired" or "stale")
        records after ``after``, in order."""
        condition = self.sweep_conditions[kind]
        params = self.sweep_params(grace)
        if after is not None:
            condition += f" AND {self.quote('id')} > %(after)s"
            params["after"] = after
        sql = (
            f"SELECT {self.quote('id')} FROM {self.table} WHERE {condition} "
            f"ORDER BY {self.quote('id')} LIMIT {int(size)}"
        )
        cursor = statement_cursor(connections[self.using])
        cursor.execute(sql, params)
        return [int(row[0]) for row in cursor.fetchall()]

    def sweep_delete(self, kind: str, first: int, last: int, grace: float = 0) -> int:
        """Delete the ``kind`` records from ``first`` to ``last`` in one
        statement that judges the condition again: a record re-claimed or
        completed since it was selected no longer matches and is kept."""
        pk = self.quote("id")
        sql = (
            f"DELETE FROM {self.table} WHERE {pk} >= %(first)s AND {pk} <= %(last)s "
            f"AND {self.sweep_conditions[kind]}"
        )
        rowcount, _ = self.execute(sql, {**self.sweep_params(grace), "first": first, "last": last})
        return int(rowcount)

    def sweep_params(self, grace: float) -> dict[str, Any]:
        return {
            "now": clock.param(self.vendor, 0),
            "stale_before": clock.param(self.vendor, -grace),
        }

    def release_selected(self, pks: Sequence[int]) -> int:
        """The admin's release: delete the selected records that are in
        progress or interrupted, in one statement."""
        if not pks:
            return 0
        names = {f"pk{index}": int(pk) for index, pk in enumerate(pks)}
        sql = (
            f"DELETE FROM {self.table} WHERE {self.quote('id')} IN "
            f"({', '.join(f'%({name})s' for name in names)}) AND {self.releasable}"
        )
        rowcount, _ = self.execute(sql, names)
        return int(rowcount)


def existing(row: Sequence[Any]) -> Existing:
    """The record a claim met, from the columns of ``existing_columns``."""
    token, operation, fingerprint, status, expired, lapsed = row[:6]
    resp_status, resp_headers, resp_body, expiring = row[6:]
    response = None
    if status == COMPLETED:
        headers = parse_headers(resp_headers)
        body = None if resp_body is None else bytes(resp_body)
        response = StoredResponse(None if resp_status is None else int(resp_status), headers, body)
    return Existing(
        token, operation, fingerprint, status, bool(expired), bool(lapsed), response, bool(expiring)
    )


# Where a connection keeps the driver's cursor for the store's statements,
# with the driver connection it belongs to.
_KEPT_CURSOR = "_idempotency_statement_cursor"
# The methods through which Django makes a cursor, any of which a backend
# (django-tenants sets the tenant's search_path in ``_cursor``), a tool
# (django-debug-toolbar replaces ``cursor``) or an agent (on the connection
# itself, as it is made) may have made its own.
_CURSOR_METHODS = ("cursor", "_cursor", "_prepare_cursor", "create_cursor", "make_cursor")
# A result at least this large is not left held by the kept cursor.
HELD_RESULT_BYTES = 64 * 1024


def statement_cursor(connection: Any) -> Any:
    """Django's cursor for one of the library's own statements, as
    ``connection.cursor()`` makes it (error translation, execute wrappers),
    over a driver cursor that the connection keeps while it stays open:
    making and closing a driver cursor costs more than the statement sent
    through it. Not closed after use; the connection's next driver
    connection gets a new one. It is ``connection.cursor()`` itself where
    that is not plainly Django's (``keeps_a_cursor``, asked once connected:
    an agent may instrument the connection as it is made)."""
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    if not keeps_a_cursor(connection):
        return connection.cursor()
    connection.validate_thread_sharing()
    return connection.make_cursor(kept_cursor(connection))


def kept_cursor(connection: Any) -> Any:
    """The driver's cursor the open ``connection`` keeps for the store's
    statements (``statement_cursor``)."""
    raw = connection.connection
    kept = vars(connection).get(_KEPT_CURSOR)
    if kept is None or kept[0] is not raw:
        with connection.wrap_database_errors:
            kept = (raw, connection.create_cursor(None))
        setattr(connection, _KEPT_CURSOR, kept)
    return kept[1]


def keeps_a_cursor(connection: Any) -> bool:
    """Whether ``connection`` makes its cursors Django's own way, neither
    replaced on the class nor on the connection; Django logs no queries
    (its log reads each statement back from the driver's cursor); and no
    other thread may use it (two threads on one cursor would read each
    other's results)."""
    return (
        judged_for_the_unit(connection, _makes_cursors_as_django_does)
        and vars(connection).keys().isdisjoint(_CURSOR_METHODS)
        and not connection.queries_logged
        and not connection.allow_thread_sharing
    )


def _makes_cursors_as_django_does(connection: Any) -> bool:
    """Whether the connection class's cursor makers are Django's own, code
    and all (an agent may replace ``BaseDatabaseWrapper.cursor`` itself)."""
    cls = type(connection)
    cursor, made, prepared = cls.cursor, cls._cursor, cls._prepare_cursor
    try:
        inner = cursor.__wrapped__  # what Django's async_unsafe wraps
        key = (
            *(cursor, cursor.__code__, inner, inner.__code__),
            *(made, made.__code__, prepared, prepared.__code__),
        )
    except AttributeError:  # not a function, or not Django's async_unsafe
        return False
    return _CURSOR_MAKERS.judge(key, (cursor, made, prepared))


# -- Whether a function is still the one its library defines --------------------

# What the checks of the functions on a cursor's way answered, per driver
# connection, for the unit running in this context (``judging_per_unit``).
_JUDGED_FOR_THE_UNIT: contextvars.ContextVar[list[tuple[Any, Any, Any, bool]] | None] = (
    contextvars.ContextVar("idempotency_judged_for_the_unit", default=None)
)


class judging_per_unit:
    """While a unit (a claim, its work and its completion) runs, the
    functions on a cursor's way are checked at its first statement that
    could go past the cursor and the answer holds for the rest of it:
    agents are installed as a process starts, or between requests, not
    in the middle of one. What a connection itself says (its execute
    wrappers, query log, driver state) is still asked per statement.
    A class: every request enters it, a replay from memory included."""

    def __enter__(self) -> None:
        self.reset = _JUDGED_FOR_THE_UNIT.set([])

    def __exit__(self, *exc_info: object) -> None:
        _JUDGED_FOR_THE_UNIT.reset(self.reset)


def judged_for_the_unit(connection: Any, check: Callable[[Any], bool], state: Any = None) -> bool:
    """``check(connection)``, answered once per driver connection and
    ``state`` (what of the connection's own the check reads, such as the
    cursor class OpenTelemetry may set on it at any time) while a unit runs
    (``judging_per_unit``), else each time."""
    judged = _JUDGED_FOR_THE_UNIT.get()
    if judged is None:
        return check(connection)
    raw = connection.connection
    for known, asked, read, answer in judged:
        if known is raw and asked is check and read is state:
            return answer
    answer = check(connection)
    judged.append((raw, check, state, answer))
    return answer


class Judgements:
    """Answers about a set of functions and their code, each set found by
    the identity of its members: an agent that replaces a function, wraps
    it in a proxy (which compares equal to what it wraps) or rewrites its
    code in place (ddtrace does) makes a new set. Found by comparing ids,
    not by hashing the objects: hashing code objects costs more than the
    lookup is worth. The sets judged are kept, and with them their
    objects, so that the id of one an agent swapped out is never given to
    another. Shared by a process's threads: the known sets and their
    answers are replaced together, in one assignment."""

    def __init__(self, answer: Callable[[Any], bool]) -> None:
        self.answer = answer
        self.known: tuple[tuple[tuple[int, ...], ...], tuple[bool, ...]] = ((), ())
        self.kept: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def judge(self, members: tuple[Any, ...], functions: Any) -> bool:
        """The answer for the set ``members``, asked of ``functions`` the
        first time."""
        key = tuple(map(id, members))
        keys, answers = self.known
        try:
            return answers[keys.index(key)]
        except ValueError:
            pass
        judged = self.answer(functions)
        with self.lock:
            keys, answers = self.known
            # A process that keeps changing them is judged each time.
            if len(keys) < 32 and key not in keys:
                self.kept.append(members)
                self.known = ((*keys, key), (*answers, judged))
        return judged


_BASE_MODULES = (BaseDatabaseWrapper.__module__,) * 3
_CURSOR_MAKERS = Judgements(lambda makers: all_own(makers, _BASE_MODULES))
_ASYNC_UNSAFE_FILE = os.path.join("django", "utils", "asyncio.py")


def all_own(functions: Sequence[Any], modules: Sequence[str]) -> bool:
    """Whether each function is a plain function of its module, with code
    compiled from that module's file (Django's ``async_unsafe`` around it
    aside): not an agent's replacement, wrapper or rewritten code."""
    return all(
        _own_function(_undecorated(f), module) for f, module in zip(functions, modules, strict=True)
    )


def _undecorated(function: Any) -> Any:
    """``function`` without Django's own ``async_unsafe`` around it (which
    ``cursor`` and ``create_cursor`` wear); any other wrapper stays."""
    code = getattr(function, "__code__", None)
    if code is not None and code.co_filename.endswith(_ASYNC_UNSAFE_FILE):
        return getattr(function, "__wrapped__", function)
    return function


def _own_function(function: Any, module: str) -> bool:
    """A plain function of ``module`` (not wrapt's proxy, nor a
    ``functools.wraps`` wrapper, which copies the module's name but leaves
    ``__wrapped__``) whose code comes from ``module``'s file, wherever it
    was installed (code an agent swaps in comes from the agent's file)."""
    return (
        type(function) is types.FunctionType
        and function.__module__ == module
        and not hasattr(function, "__wrapped__")
        and function.__code__.co_filename.endswith(module.replace(".", os.sep) + ".py")
    )


def is_large(headers: str | None, body: bytes | None) -> bool:
    """Whether a response's stored headers and body are large enough that
    the kept cursor that read or wrote them should not hold them until the
    connection's next statement."""
    return len(headers or "") + len(body or b"") >= HELD_RESULT_BYTES


def let_go_of_large_results(connection: Any) -> None:
    """Close the kept cursor after a large result (a replayed body of
    ``HELD_RESULT_BYTES`` or more), rather than hold it until the
    connection's next statement."""
    kept = vars(connection).pop(_KEPT_CURSOR, None)
    if kept is not None:
        kept[1].close()


def runs_alone(connection: Any) -> bool:
    """Whether a statement sent now is a transaction of its own. A
    connection not opened yet (the first query of a request under the
    default CONN_MAX_AGE = 0) reports autocommit off until it connects: its
    settings say what it will be."""
    if connection.in_atomic_block:
        return False
    if connection.connection is None:
        return bool(connection.settings_dict.get("AUTOCOMMIT", True))
    return bool(connection.autocommit)


def refuse_unstorable(identity: Identity, using: str) -> None:
    raise UnstorableIdentity(
        f"The idempotency scope, key or operation of {identity.key!r} holds characters "
        f"outside the Basic Multilingual Plane, which the connection to database {using!r} "
        'cannot store: set DATABASES[...]["OPTIONS"] = {"charset": "utf8mb4"}.'
    )
