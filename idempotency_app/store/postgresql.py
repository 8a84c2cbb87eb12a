"""PostgreSQL: the claim and the read of a taken key in one statement."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from django.db import ProgrammingError, connections, transaction
from django.db.backends import utils

try:
    from psycopg import adapt, errors, generators, pq
except ImportError:  # psycopg2: the store's statements go through Django's cursor
    adapt = errors = generators = pq = None  # type: ignore[assignment, unused-ignore]

from idempotency_app.store import base
from idempotency_app.store.base import (
    CLAIMED,
    Claimed,
    Existing,
    Identity,
    StoredResponse,
    keeps_a_cursor,
)

# What the completion sent with its COMMIT fails with when it matches no row:
# the failure skips the COMMIT, so the work rolls back.
CLAIM_LOST = "idempotency_app: the claim was taken over, rolling the work back"

logger = logging.getLogger("idempotency_app")

# The claim statement as a PL/pgSQL function (migration 0007), and the
# parameters it takes in order, before whether it runs alone.
CLAIM_FUNCTION = "idempotency_claim_v1"
CLAIM_ARGUMENTS = (
    "scope",
    "key",
    "operation",
    "fingerprint",
    "token",
    "now",
    "expires",
    "lease",
    "soon",
)
# What a call of a function that is gone or not ours to call fails with.
UNCALLABLE = frozenset({"42883", "42501"})  # undefined_function, insufficient_privilege
_CLAIM_SIGNATURE = f"{CLAIM_FUNCTION}(text,text,text,text,text,float8,float8,float8,float8,boolean)"
# The completion sent with the COMMIT as a PL/pgSQL function (migration 0008),
# called in a savepoint of its own.
COMPLETE_FUNCTION = "idempotency_complete_v1"
_COMPLETE_SIGNATURE = f"{COMPLETE_FUNCTION}(text,text,text,float8,integer,text,bytea)"
COMPLETING = "idempotency_app_completes"
# The claim function's argument types, as libpq takes them (text, float8).
_CLAIM_TYPES = (25,) * 5 + (701,) * 4
# The attribute on the statement guard's cursor class that names the
# driver's class it guards (``lifecycle.work.guard_raw_cursors``).
GUARDED_CLASS = "_idempotency_guarded_class"
# libpq's CONNECTION_OK: an open connection.
_CONNECTION_OK = 0
# The savepoint the question which of the store's functions can be called is
# asked in, inside the caller's transaction (``store_functions``).
ASKING = "idempotency_app_asks"


class Backend(base.Backend):
    vendor = "postgresql"

    def __init__(self, using: str) -> None:
        super().__init__(using)
        on_conflict = f"ON CONFLICT ({self.quote('scope')}, {self.quote('key')}) DO NOTHING"

        # The INSERT and the read of the record it collided with, in one round
        # trip. NOT EXISTS keeps replays from drawing a sequence value (and
        # from forcing a WAL flush every 32 of them); ON CONFLICT still
        # arbitrates two fresh claims racing.
        def claim(cfg: str = "", join: str = "") -> str:
            return (
                f"WITH ins AS ({self.insert_into} SELECT {self.claim_values} "
                f"WHERE NOT EXISTS (SELECT 1 FROM {self.table} WHERE {self.where_key}) "
                f"{on_conflict} RETURNING 1){cfg} "
                f"SELECT {', '.join(['NULL'] * 10)} FROM ins{join} "
                f"UNION ALL {self.select}"
            )

        self.claim_sql = claim()
        # The same statement as a function that the server plans once per
        # connection (migration 0007), where that migration has run.
        arguments = ", ".join(f"%({name})s" for name in CLAIM_ARGUMENTS)
        self.claim_calls = {
            alone: f"SELECT * FROM {CLAIM_FUNCTION}({arguments}, {alone})"
            for alone in (False, True)
        }
        numbered = ", ".join(f"${n}" for n in range(1, len(CLAIM_ARGUMENTS) + 1))
        self.unseen_claim_calls = {
            alone: f"SELECT * FROM {CLAIM_FUNCTION}({numbered}, {alone})".encode()
            for alone in (False, True)
        }
        self.claims_by_function: bool | None = None
        # Outside any transaction, the claim's commit does not wait for its
        # WAL flush. WAL is flushed in order, so the work's own (synchronous)
        # commit makes the claim durable too; a crash can only lose a claim
        # whose work never committed, which a retry then runs. Never inside a
        # transaction, where it would make the caller's commit asynchronous.
        self.claim_alone_sql = claim(
            ", cfg AS (SELECT set_config('synchronous_commit', 'off', true))", " CROSS JOIN cfg"
        )
        # The completion and the COMMIT in one message: a completion that
        # matches no row fails (a cast the planner cannot fold, since it
        # reads the count), and a failed statement skips the rest of the
        # message, so the work then rolls back rather than commit without it.
        self.complete_commit_sql = (
            f"WITH done AS ({self.complete_sql} RETURNING 1) "
            f"SELECT CASE count(*) WHEN 1 THEN 1 "
            f"ELSE CAST('{CLAIM_LOST}: ' || count(*) AS integer) END FROM done; COMMIT"
        )
        # The same as a function the server plans once per connection
        # (migration 0008), which raises where the statement's cast fails,
        # in a savepoint of its own: a session that cannot call it goes back
        # to the savepoint and sends the statement, the work intact.
        self.complete_commit_call = (
            f"SAVEPOINT {COMPLETING}; "
            f"SELECT {COMPLETE_FUNCTION}(%(scope)s, %(key)s, %(token)s, %(expires)s, "
            "%(status)s, %(headers)s, %(body)s); COMMIT"
        )
        # Asked with the claim function's, at the first claim.
        self.completes_by_function = False

    def sending(self, connection: Any) -> AbstractContextManager[Any]:
        """In psycopg's pipeline mode a statement's result arrives only at
        the next sync, and its row count and rows read as none before it:
        leaving a pipeline block nested in the caller's syncs."""
        raw = connection.connection
        if getattr(getattr(raw, "pgconn", None), "pipeline_status", None):
            return raw.pipeline()  # type: ignore[no-any-return]
        return contextlib.nullcontext()

    def claim(
        self, identity: Identity, token: str, ttl: float, lease: float, connection: Any = None
    ) -> Existing | Claimed | None:
        if connection is None:
            connection = connections[self.using]
        alone = base.runs_alone(connection)
        params = self.claim_params(identity, token, ttl, lease)
        # Connected first: the claim statement is chosen on the open connection.
        cursor = None if _claims_unseen(connection, params) else _preparing_cursor(connection)
        sql = self.claim_statement(alone)
        try:
            if cursor is None and sql == self.claim_calls[alone]:
                row = self._call_unseen(connection, alone, params)
            else:
                cursor = cursor or _preparing_cursor(connection)
                self.adapt(cursor.cursor)
                cursor.execute(sql, params)
                row = cursor.fetchone()
        except ProgrammingError as exc:
            code = getattr(exc.__cause__, "sqlstate", None)
            if sql != self.claim_calls[alone] or code not in UNCALLABLE:
                raise
            self._give_up_the_function(exc)
            if not alone or connection.connection.pgconn.pipeline_status:
                raise  # the failed call spoiled the caller's transaction
            # The call failed before the function ran, in a transaction
            # of its own: nothing to undo.
            cursor = cursor or _preparing_cursor(connection)
            self.adapt(cursor.cursor)
            cursor.execute(self.claim_statement(alone), params)
            row = cursor.fetchone()
        if row is None:
            # Lost the race to a row this statement's snapshot cannot see yet.
            return self.fetch(identity, connection)
        return CLAIMED if row[0] is None else self.found(row, connection)

    def _call_unseen(self, connection: Any, alone: bool, params: dict[str, Any]) -> Any:
        """The claim function's row, called through libpq's own call with
        its arguments apart from the text (``_claims_unseen``): no Django
        or psycopg cursor to pass through, which costs several times what
        the call itself does. Its row is read as psycopg reads a cursor's."""
        raw = connection.connection
        # Each by its value, as psycopg binds it: str() of a str subclass (a
        # ``(str, Enum)`` member) need not be its value.
        texts = [str.encode(params[name]) for name in CLAIM_ARGUMENTS[:5]]
        values = texts + [repr(float(params[name])).encode() for name in CLAIM_ARGUMENTS[5:]]
        call = self.unseen_claim_calls[alone]
        with connection.wrap_database_errors:
            result = _exchange(
                raw, lambda: raw.pgconn.send_query_params(call, values, _CLAIM_TYPES)
            )[-1]
            _raise_for(raw, result, pq.ExecStatus.TUPLES_OK)
        if not result.ntuples:
            return None
        if result.get_value(0, 0) is None:
            return (None,)
        rows = _row_reader(connection)
        rows.set_pgresult(result)
        try:
            return rows.load_row(0, tuple)
        finally:
            rows.set_pgresult(None)  # not kept holding a large replayed body

    def _give_up_the_function(self, exc: Exception) -> None:
        """The function is gone, or this session cannot call it (a migration
        back to 0006, ``EXECUTE`` revoked, a ``search_path`` without it):
        the statement, for the life of the process."""
        self.claims_by_function = self.completes_by_function = False
        logger.warning(
            "idempotency_app: cannot call %s on database %r (%s); claims send the statement "
            "itself from now on. Run migrate, and grant EXECUTE on it where the table is.",
            CLAIM_FUNCTION,
            self.using,
            exc,
        )

    def _give_up_the_completion_function(self, exc: Exception) -> None:
        """The completion function is gone, or this session cannot call it
        (a migration back to 0007, a tenant's schema not migrated yet,
        ``EXECUTE`` revoked): completions send the statement for the life
        of the process, this one included."""
        self.completes_by_function = False
        logger.warning(
            "idempotency_app: cannot call %s on database %r (%s); completions send the "
            "statement itself from now on. Run migrate in every schema that holds the table, "
            "and grant EXECUTE on it there.",
            COMPLETE_FUNCTION,
            self.using,
            exc,
        )

    def claim_statement(self, alone: bool) -> str:
        """The claim as the function where migration 0007 has run and this
        session may call it (asked on the open connection at the first
        claim, then never again), else the statement itself."""
        if self.claims_by_function is None:
            answer = store_functions(connections[self.using].connection)
            if answer is not None:
                self.claims_by_function, self.completes_by_function = answer
        if self.claims_by_function:
            return self.claim_calls[alone]
        return self.claim_alone_sql if alone else self.claim_sql

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
        """Where the driver sends statements as text (psycopg 3's client-side
        binding, Django's default, outside pipeline mode), ``before`` goes in
        front of the completion in one message, and with ``commit`` so does
        the COMMIT after it: one round trip instead of two, and Django's own
        commit then finds nothing to do. Any error then leaves it to the
        caller to read back what committed. With the COMMIT, the completion
        is migration 0008's function where the session may call it (asked
        with the claim function's): the server plans it once per session."""
        if connection is None:
            connection = connections[self.using]
        if not carries_statements_on(connection.connection):
            return super().complete(identity, token, response, ttl, commit, before, connection)
        params = self.complete_params(identity, token, response, ttl)
        sql = self.completion_statement(commit)
        unseen = _sends_unseen_in_transaction(connection)
        try:
            return _send_completion(connection, unseen, before, sql, params, commit)
        except ProgrammingError as exc:
            code = getattr(exc.__cause__, "sqlstate", None)
            if sql is not self.complete_commit_call or code not in UNCALLABLE:
                raise
            self._give_up_the_completion_function(exc)
        # Nothing after the savepoint in front of the call ran: back to it,
        # and the statement instead, the work intact.
        undo = [f"ROLLBACK TO SAVEPOINT {COMPLETING}"]
        return _send_completion(connection, unseen, undo, self.complete_commit_sql, params, commit)

    def completion_statement(self, commit: bool) -> str:
        """The completion, and with ``commit`` the COMMIT after it: the
        function where the session may call it, else the statement."""
        if not commit:
            return self.complete_sql
        return self.complete_commit_call if self.completes_by_function else self.complete_commit_sql

    def carries_statements(self, connection: Any = None) -> bool:
        return carries_statements_on((connection or connections[self.using]).connection)

    def adapt(self, cursor: Any) -> None:
        """A cursor that binds parameters on the server (Django's
        ``server_side_binding``, or the prepared claim's) sends strings as
        text: sent as "unknown", one used twice (the key, in the claim's
        INSERT and its NOT EXISTS) would get two types and fail."""
        if not makes_text_cursors(type(cursor)):
            from psycopg.types.string import StrDumper

            cursor.adapters.register_dumper(str, StrDumper)

    def renews_in_place(self) -> bool:
        """At REPEATABLE READ or SERIALIZABLE, the work could not complete a
        row that another connection changed after its snapshot. A transaction
        already marked for rollback takes no statement: it commits nothing,
        so a connection of its own serves."""
        connection = connections[self.using]
        if connection.in_atomic_block and transaction.get_rollback(using=self.using):
            return False
        return self.isolation_level() not in ("read committed", "read uncommitted")

    def isolation_level(self) -> str:
        """The transaction's isolation level, as ``SHOW`` names it."""
        _, row = self.execute("SHOW transaction_isolation", None)
        return str(row[0])


def carries_statements_on(raw: Any) -> bool:
    """Whether the driver connection ``raw`` sends several statements in
    one message (psycopg 3's client-side cursors, outside pipeline mode)."""
    return (
        raw is not None
        and makes_text_cursors(getattr(raw, "cursor_factory", None))
        and raw.pgconn.pipeline_status == 0
    )


def sent_unseen(connection: Any) -> bool:
    """Whether a statement of the library's sent through libpq's own call,
    past Django's cursor and psycopg's, is missed by nobody: Django makes
    cursors its own way and logs no queries (``keeps_a_cursor``); no agent
    has replaced or wrapped ``CursorWrapper.execute``, the driver cursor's
    ``execute`` or the driver connection itself; psycopg binds as text,
    outside pipeline mode; and the session speaks UTF-8. Execute wrappers
    are the caller's to check."""
    return keeps_a_cursor(connection) and unseen_by_agents(connection)


def unseen_by_agents(connection: Any) -> bool:
    """``sent_unseen`` but for how Django makes its cursors: psycopg's own
    connection (not an agent's proxy), Django's and psycopg's own functions
    all along the way a statement takes through a cursor, the connection
    open, outside pipeline mode, and in a session in UTF-8 (what the
    library's statements are encoded in when sent this way). Asked several
    times per request: what an agent could have replaced is answered once
    per unit (``base.judging_per_unit``) and once per set of those
    functions and their code (``_agent_free``), the rest read from libpq."""
    raw = connection.connection
    # type(), not __class__, which a proxy forwards; a cursor maker set on
    # the connection itself is an agent's.
    if type(raw) is not _psycopg_connection() or "cursor" in getattr(raw, "__dict__", ()):
        return False
    if not base.judged_for_the_unit(connection, _functions_own, raw.cursor_factory):
        return False
    pgconn = raw.pgconn
    return bool(
        pgconn.pipeline_status == 0
        and pgconn.status == _CONNECTION_OK  # else its errors are Django's to raise
        and pgconn.parameter_status(b"client_encoding") == b"UTF8"
    )


def _functions_own(connection: Any) -> bool:
    """``unseen_by_agents``'s question of the functions on a cursor's way."""
    raw = connection.connection
    raw_class: Any = type(raw)
    factory = raw.cursor_factory
    driver = getattr(factory, "__dict__", {}).get(GUARDED_CLASS, factory)  # not a subclass's
    django = type(connection)
    wrapper = utils.CursorWrapper
    make, create = django.make_cursor, django.create_cursor
    execute, executor = wrapper.execute, wrapper._execute  # type: ignore[attr-defined]
    wrappers = wrapper._execute_with_wrappers  # type: ignore[attr-defined]
    init = wrapper.__init__
    try:
        created = getattr(create, "__wrapped__", create)  # what Django's async_unsafe wraps
        key = (
            *(factory, make, make.__code__, create, create.__code__, created, created.__code__),
            *(execute, execute.__code__, wrappers, wrappers.__code__, executor, executor.__code__),
            *(init, init.__code__),
            *(raw_class.cursor, raw_class.cursor.__code__, driver.execute, driver.execute.__code__),
        )
    except AttributeError:  # not a function: an agent's
        return False
    return _AGENT_FREE.judge(key, key)


def _past_the_cursor(connection: Any) -> bool:
    """Whether nobody would miss a statement sent now through libpq's own
    call: no execute wrapper, and ``sent_unseen`` once the connection is
    open and checked as Django's cursor would check it."""
    return (
        not connection.execute_wrappers
        and _checked_as_by_cursor(connection)
        and unseen_by_agents(connection)
    )


def _sends_unseen_in_transaction(connection: Any) -> bool:
    """Whether the completion can go through libpq's own call: nobody would
    miss it (``_past_the_cursor``), and a transaction is open and has not
    failed (psycopg would send nothing first)."""
    return _past_the_cursor(connection) and in_open_transaction(connection.connection)


def _send_completion(
    connection: Any,
    unseen: bool,
    before: Sequence[str],
    sql: str,
    params: dict[str, Any],
    commit: bool,
) -> bool:
    """The completion with ``before`` in front, through libpq's own call
    where nobody would miss it (``unseen``), else Django's cursor: whether
    it matched the claim (always, with ``commit``: else it failed)."""
    if unseen:
        return _complete_unseen(connection, before, sql, params, commit)
    cursor = base.statement_cursor(connection)
    if before:
        cursor.execute(*_joined(cursor.cursor, before, sql, params))
    else:
        cursor.execute(sql, params)
    matched = True
    if not commit:
        for _ in before:
            cursor.nextset()  # to the completion's own result
        matched = cursor.rowcount == 1
    if base.is_large(params["headers"], params["body"]):  # held in the statement's text
        base.let_go_of_large_results(connection)
    return matched


def _complete_unseen(
    connection: Any, before: Sequence[str], sql: str, params: dict[str, Any], commit: bool
) -> bool:
    """The completion (``before`` in front, the COMMIT after it with
    ``commit``) as one message through libpq's own call, bound as text by
    psycopg as its cursor would: whether it matched the claim. libpq
    answers with the last statement's result, or the first that failed."""
    raw = connection.connection
    bound = _bound(raw, sql, params)
    if bound is None:
        bound = base.kept_cursor(connection).mogrify(sql, params).encode()
    message = b"; ".join([*(statement.encode() for statement in before), bound])
    with connection.wrap_database_errors:
        result = _exchange(raw, lambda: raw.pgconn.send_query(message))[-1]
        _raise_for(raw, result, pq.ExecStatus.COMMAND_OK)
    return commit or result.command_tuples == 1


def _bound(raw: Any, sql: str, params: dict[str, Any]) -> bytes | None:
    """``sql`` with ``params`` written in as literals by libpq's own escaping
    for this session, as psycopg's ``mogrify`` writes them, without its
    adapters' machinery (nearly half of what the completion's Python cost);
    None where a value is not one of the kinds the store sends (a ``str``
    subclass, a float that is not finite, text holding NUL): ``mogrify``
    then writes it, or refuses it."""
    escaping = pq.Escaping(raw.pgconn)
    # escape_bytea() doubles backslashes where strings read them as escapes,
    # which then need the E'' syntax.
    standard = raw.pgconn.parameter_status(b"standard_conforming_strings") == b"on"
    opens_bytea = b"'" if standard else b" E'"
    literals: dict[bytes, bytes] = {}
    for name, value in params.items():
        kind = type(value)
        if kind is str and "\x00" not in value:
            literal = escaping.escape_literal(value.encode())
        elif kind is bytes:
            literal = opens_bytea + escaping.escape_bytea(value) + b"'::bytea"
        elif kind is int:  # type(True) is bool: not written here
            literal = b"%d" % value
        elif kind is float and math.isfinite(value):
            literal = repr(value).encode()
        elif value is None:
            literal = b"NULL"
        else:
            return None
        if literal.startswith(b"-"):  # "1-%s" must not become a comment, "1--5"
            literal = b" " + literal
        literals[name.encode()] = literal
    return sql.encode() % literals


# Where a connection keeps the reader of the claim's rows, with the driver
# connection it belongs to.
_ROW_READER = "_idempotency_row_reader"


def _row_reader(connection: Any) -> Any:
    """psycopg's reader of result rows (its ``Transformer``, what its
    cursors read rows with), kept per driver connection as the kept cursor
    is: a new one makes each column's loader again, as much as the rest
    of the read."""
    raw = connection.connection
    kept = vars(connection).get(_ROW_READER)
    if kept is None or kept[0] is not raw:
        kept = (raw, adapt.Transformer.from_context(raw))
        setattr(connection, _ROW_READER, kept)
    return kept[1]


def _checked_as_by_cursor(connection: Any) -> bool:
    """Check the connection as Django does before it makes a cursor or
    runs a statement, connecting it if need be; False where Django would
    not keep a cursor of its own (``keeps_a_cursor``), asked once connected,
    as an agent may instrument the connection as it is made."""
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    if not keeps_a_cursor(connection):
        return False
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    return True


def _claims_unseen(connection: Any, params: dict[str, Any]) -> bool:
    """Whether the claim function can be called through libpq's own call:
    nobody would miss the statement (``_past_the_cursor``); psycopg would
    send nothing first (autocommit, or a transaction already open); it
    prepares nothing (``prepare_threshold`` unset, Django's default); and no
    argument holds a NUL, which libpq would cut it at (psycopg refuses it:
    the cursor's way raises as before)."""
    if not _past_the_cursor(connection):
        return False
    raw = connection.connection
    return (
        raw.prepare_threshold is None
        and (raw.autocommit or in_open_transaction(raw))
        and "\x00" not in "".join([params[name] for name in CLAIM_ARGUMENTS[:5]])
    )


# Where each function along a cursor's way must come from, in the order
# ``unseen_by_agents`` lists them.
_PATH_MODULES = (
    "django.db.backends.base.base",
    "django.db.backends.postgresql.base",
    *[utils.__name__] * 4,
    "psycopg.connection",
    "psycopg.cursor",
)


@functools.cache
def _psycopg_connection() -> Any:
    try:
        from psycopg import Connection
    except ImportError:  # psycopg2
        return None
    return Connection


def _agent_free(key: tuple[Any, ...]) -> bool:
    """Whether no agent stands between a statement and the server: every
    function along a cursor's way (Django's ``make_cursor``,
    ``create_cursor`` and ``CursorWrapper`` methods and maker, psycopg's
    ``Connection.cursor`` and its cursor's ``execute``) is its library's
    own (``base.all_own``), and the cursors are psycopg's client-side ones.
    An agent replaces or wraps one of them (Sentry and Scout patch
    ``CursorWrapper.execute``; OpenTelemetry's psycopg instrumentation sets
    ``cursor_factory``; ddtrace rewrites a function's code in place).
    Django's cursor makers are ``keeps_a_cursor``'s to judge."""
    factory, functions = key[0], key[1::2]  # each function, then its code
    outers = functions[:2] + functions[3:]  # what create_cursor wraps is judged with it
    return makes_text_cursors(factory) and base.all_own(outers, _PATH_MODULES)


_AGENT_FREE = base.Judgements(_agent_free)


def _joined(
    cursor: Any, before: Sequence[str], sql: str, params: dict[str, Any]
) -> tuple[str, dict[str, Any] | None]:
    """``before`` and the statement as one message, and its parameters.
    Bound on its own, then joined: psycopg caches what it makes of a
    statement's text by the whole text, and the releases in front name
    other savepoints on each request, so the joined text would be parsed
    anew each time (and crowd its cache). Where psycopg cannot read its own
    binding back as text (a ``SQL_ASCII`` session, whose strings it still
    sends as UTF-8), the parameters go apart, as before."""
    try:
        return "; ".join([*before, cursor.mogrify(sql, params)]), None
    except UnicodeDecodeError:
        return "; ".join([*before, sql]), params


def sends_text(cursor: Any) -> bool:
    """Whether ``cursor`` (the driver's) sends a statement with its
    parameters as text in one simple query, which may hold several
    statements: psycopg 3's client-side cursors, outside pipeline mode.
    (psycopg2 does too, but keeps its own idea of the transaction and would
    send COMMIT again.)"""
    return makes_text_cursors(type(cursor)) and cursor.connection.pgconn.pipeline_status == 0


def makes_text_cursors(cursor_class: Any) -> bool:
    """Whether cursors of ``cursor_class`` are psycopg 3's client-side ones
    (asked several times per request, so answered once per class)."""
    return isinstance(cursor_class, type) and _is_client_cursor_class(cursor_class)


@functools.cache
def _is_client_cursor_class(cursor_class: type) -> bool:
    try:
        from psycopg import ClientCursor
    except ImportError:
        return False
    return issubclass(cursor_class, ClientCursor)


def _preparing_cursor(connection: Any) -> Any:
    """A cursor for the claim that psycopg 3 prepares once it has run the
    statement ``prepare_threshold`` times on the connection: the server then
    neither parses nor plans it again, about 0.2 ms of its CPU per claim.
    Django turns preparing off (``prepare_threshold`` None, for connection
    poolers) unless ``OPTIONS`` sets it; then Django's own cursors, which
    send text (client-side binding), still never prepare, and this one,
    which binds parameters on the server (strings as text, so that one used
    twice has one type), does. It is Django's cursor wrapper all the same
    (execute wrappers, query logging, error translation)."""
    cursor = base.statement_cursor(connection)  # connected and checked, as by cursor()
    raw = connection.connection
    if getattr(raw, "prepare_threshold", None) is None or not makes_text_cursors(
        getattr(raw, "cursor_factory", None)
    ):
        return cursor
    from psycopg import Cursor

    with connection.wrap_database_errors:
        prepared = Cursor(raw)
    if connection.queries_logged:
        return connection.make_debug_cursor(prepared)
    return connection.make_cursor(prepared)


def store_functions(raw: Any) -> tuple[bool, bool] | None:
    """Whether the claim function, and whether the completion function,
    exists where the connection looks for it and the session may call it
    (None: not known yet, ask again). Asked once
    per process and alias, through libpq's own call: outside psycopg's
    transaction handling (it opens no transaction), and unseen by the query
    log, so that the first request a process serves counts the statements
    every other one does. Inside the caller's transaction it is asked in a
    savepoint of its own, so that its failure leaves that transaction as it
    was. psycopg2 sends the statement itself."""
    if raw is None:
        return None  # not connected yet
    pgconn = getattr(raw, "pgconn", None)
    if pgconn is None:
        return False, False
    status = pgconn.transaction_status
    if pgconn.pipeline_status or status not in (
        pq.TransactionStatus.IDLE,
        pq.TransactionStatus.INTRANS,
    ):
        return None
    question = "SELECT " + ", ".join(
        f"coalesce(has_function_privilege(to_regprocedure('{signature}'), 'EXECUTE'), false)"
        for signature in (_CLAIM_SIGNATURE, _COMPLETE_SIGNATURE)
    )
    inside = status == pq.TransactionStatus.INTRANS
    if inside:
        question = f"SAVEPOINT {ASKING}; {question}; RELEASE SAVEPOINT {ASKING}"
    try:
        results = _exchange(raw, lambda: pgconn.send_query(question.encode()))
        if all(r.status != pq.ExecStatus.FATAL_ERROR for r in results):
            answer = next(r for r in results if r.status == pq.ExecStatus.TUPLES_OK)
            return answer.get_value(0, 0) == b"t", answer.get_value(0, 1) == b"t"
        if inside:
            undo = f"ROLLBACK TO SAVEPOINT {ASKING}; RELEASE SAVEPOINT {ASKING}"
            _exchange(raw, lambda: pgconn.send_query(undo.encode()))
    except errors.Error:  # the connection failed: the claim that follows meets it
        pass
    return None


def begin_with(connection: Any, statement: str) -> bool:
    """Open the transaction with ``statement`` (the work's first SAVEPOINT)
    in the BEGIN's own round trip, where psycopg would send BEGIN alone and
    then the statement; False, sending nothing, unless the transaction is
    not open yet and opens with a plain BEGIN (``_opens_plainly``). It is
    sent at once, so no statement can slip in before it, through libpq's own
    call: psycopg would send its BEGIN first."""
    if not _opens_plainly(connection.connection):
        return False
    send_at_once(connection, "BEGIN; " + statement)
    return True


def _opens_plainly(raw: Any) -> bool:
    """Whether psycopg would open a transaction before the next statement,
    with a plain BEGIN (no isolation level, read-only or deferrable setting
    on the connection)."""
    return (
        not raw.autocommit
        and raw.pgconn.transaction_status == pq.TransactionStatus.IDLE
        and not raw.pgconn.pipeline_status
        and (raw.isolation_level, raw.read_only, raw.deferrable) == (None, None, None)
    )


def in_open_transaction(raw: Any) -> bool:
    """Whether a transaction is open and has not failed (a statement sent
    now runs in it, with nothing psycopg would send first)."""
    return bool(raw.pgconn.transaction_status == pq.TransactionStatus.INTRANS)


def send_at_once(connection: Any, sql: str) -> None:
    """Send ``sql`` (statements that return no rows) through libpq's own
    call, raising what psycopg would: no cursor to make, and nothing psycopg
    adds in front. Its transaction handling reads the session's status from
    libpq, so a BEGIN sent here is psycopg's transaction too."""
    raw = connection.connection
    message = sql.encode()
    with connection.wrap_database_errors:
        result = _exchange(raw, lambda: raw.pgconn.send_query(message))[-1]
        _raise_for(raw, result, pq.ExecStatus.COMMAND_OK)


def _exchange(raw: Any, send: Callable[[], None]) -> list[Any]:
    """Send through libpq's own call and read the results, up to the first
    that failed (the last is the one that counts), waiting as psycopg's
    cursors wait: in Python, so that a signal's exception (Ctrl-C,
    gunicorn's ``SystemExit`` on a worker timeout) cancels the statement
    rather than wait for the server, and notifications reach the
    connection's handlers."""
    with raw.lock:
        send()
        return raw.wait(generators.execute(raw.pgconn))  # type: ignore[no-any-return]


def _raise_for(raw: Any, result: Any, expected: Any) -> None:
    """Raise what psycopg would for a ``result`` of libpq's own call that
    is not of the ``expected`` status: the server's error where it sent one
    (a session terminated by an administrator is ``AdminShutdown``), else
    the connection's."""
    if result.status == expected:
        return
    if result.status != pq.ExecStatus.FATAL_ERROR and raw.pgconn.status != pq.ConnStatus.OK:
        raise errors.OperationalError(raw.pgconn.get_error_message(raw.info.encoding))
    raise errors.error_from_result(result, encoding=raw.info.encoding)
