"""What work under a claim may do to the database, enforced while it runs.

The work and its stored outcome must commit as one transaction on the
claim's database. These would break that, and each is stopped where it
happens rather than discovered later:

- a write to another database, which would commit on its own. Every
  statement sent to another database must be a read by the rule of
  ``statements.is_read``; anything else is refused before it runs.
- ``transaction.atomic(durable=True)``, which would commit on its own.
- a statement that starts or ends the transaction on the claim's database
  (``COMMIT``; on MySQL any DDL, ``SET autocommit`` and ``CALL``, which
  commit implicitly or may), refused before it runs by
  ``statements.ends_transaction``.
- anything else that ends the transaction: a procedure's COMMIT, a prepared
  statement, the driver's own ``commit()``, SQLite's ``executescript()``.
  The driver reports after every statement whether the transaction is still
  open (``drivers``); once it was open and is not, part of the work may
  have committed, so ``TransactionEnded`` is raised at once and the key
  keeps that answer: it never runs again by itself (``core.OutcomeUnknown``).
- a database error the work catches and carries on after: Django marks the
  transaction for rollback when an ORM write fails, not when a read such as
  ``select_for_update`` does, while MySQL has already rolled the whole
  transaction back (a deadlock). Every failed statement marks it here, so
  the work's success is reported as rolled back, never stored.

Refusals raise ``CannotBeAtomic`` and are remembered: work that catches
one still fails.

Besides the execute wrappers Django offers, psycopg 3 cursors run SQL from
``copy()`` and ``stream()``: ``guard_raw_cursors`` gives every PostgreSQL
connection a cursor class that judges those statements the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.db.transaction import Atomic

from idempotency_app.exceptions import CannotBeAtomic, TransactionEnded
from idempotency_app.lifecycle import drivers, statements
from idempotency_app.store import Identity
from idempotency_app.store.postgresql import (
    GUARDED_CLASS,
    begin_with,
    in_open_transaction,
    makes_text_cursors,
    send_at_once,
    sends_text,
    sent_unseen,
)


class UnitAtomic(Atomic):
    """The transaction (or savepoint) holding the work and its outcome.

    Django refuses ``atomic(durable=True)`` directly inside another block by
    reading that block's ``_from_testcase`` (no public hook says a durable
    block was asked for; ``tests/lifecycle/test_work.py`` fails loudly if Django stops
    reading it); reading ours records the refusal, so work that swallows
    Django's RuntimeError still fails.
    """

    def __init__(self, using: str) -> None:
        super().__init__(using, savepoint=True, durable=False)

    @property
    def _from_testcase(self) -> bool:
        _refuse(
            "transaction.atomic(durable=True) ran inside the work. A durable block commits on "
            "its own, so its writes could commit without the stored outcome and run again on "
            "a retry. Remove durable=True from code that idempotent views and tasks call "
            "(their whole work already commits as one unit with the outcome), or move that "
            "code out of the idempotent work."
        )
        return False

    @_from_testcase.setter
    def _from_testcase(self, value: bool) -> None:
        pass  # Atomic.__init__ sets it; a unit is never a test case's block


class _WorkState:
    """The work running in this context: its refusals, and what the driver
    has said of its transaction."""

    def __init__(self, identity: Identity, using: str) -> None:
        connection: Any = connections[using]
        self.connection = connection
        self.identity = identity
        self.using = using
        self.vendor = connection.vendor
        self.refusals: list[CannotBeAtomic] = []
        self.transaction_open = drivers.transaction_probe(connection)
        # The work's server session: a driver cursor's statement on another
        # session cannot commit with the work.
        self.session = drivers.session(connection.connection)
        # The transaction has been seen open: seen closed from now on, it ended.
        self.started = False
        self.ended: TransactionEnded | None = None
        # The server rolled the transaction back (a deadlock) while it ran, or
        # refused a release the work would have failed at (``_release_refused``).
        self.rolled_back = False
        # The statement Django's execute wrapper is judging, which the
        # driver's cursor it reaches need not judge again.
        self.judging: Any = None
        # Per alias: its connection (in this thread), vendor and quoting
        # probe, looked up once rather than per statement.
        self._databases = {using: _described(connection)}
        # Django's SAVEPOINT and RELEASE SAVEPOINT statements not sent yet:
        # each goes with the next statement (``_Savepoints``).
        self.savepoints = (
            _Savepoints()
            if self.vendor == "postgresql"
            and makes_text_cursors(getattr(connection.connection, "cursor_factory", None))
            else None
        )
        self.observe()

    def observe(self) -> None:
        """Ask the driver; raise ``TransactionEnded`` if the transaction ended."""
        if self.ended is not None:
            raise self.ended
        is_open = None if self.transaction_open is None else self.transaction_open()
        if is_open:
            self.started = True
        elif is_open is not None and self.started:
            self.ended = TransactionEnded(
                f"The transaction of the work under idempotency key {self.identity.key!r} "
                f"ended while it ran (a COMMIT or ROLLBACK through the driver, a procedure, a "
                "prepared statement, or a statement that commits implicitly), so part of the "
                "work may have committed. The key will answer that its outcome is unknown "
                "until an operator releases it. Leave transaction control to the library: "
                "run such statements outside idempotent work."
            )
            raise self.ended

    def unsent_releases(self) -> list[str]:
        """The work's RELEASE SAVEPOINTs still held when it ended. They must
        reach the server before the outcome is stored: one it refuses (a
        savepoint the work rolled back past, or released twice) fails the
        work, as it would have without a key (``units.Unit.complete``)."""
        return [] if self.savepoints is None else self.savepoints.held

    def database(self, alias: str) -> tuple[Any, str, statements.SessionQuoting]:
        found = self._databases.get(alias)
        if found is None:
            found = self._databases[alias] = _described(connections[alias])
        return found

    def after_error(self, exc: DatabaseError) -> None:
        """After a failed statement. A deadlock or a lock timeout that closed
        the transaction is the server's rollback: nothing of it committed,
        and the statements after it start anew. On MySQL any other error may
        follow an implicit commit (DDL that then failed), and an error reply
        carries no status: the driver is asked again, and a closed
        transaction means part of the work may have committed."""
        if self.transaction_open is None:
            return
        if drivers.is_lock_conflict(exc):
            ended = (
                drivers.is_deadlock(exc) if self.vendor == "mysql" else not self.transaction_open()
            )
            if self.vendor == "mysql" or ended:
                self.started = False
            # Whatever the work does next (even set_rollback(False)), what it
            # did before is gone: it can never be stored as a success.
            self.rolled_back = self.rolled_back or ended
            return
        if self.vendor == "mysql":
            drivers.refresh_status(connections[self.using])
        with contextlib.suppress(TransactionEnded):
            self.observe()


def _described(connection: Any) -> tuple[Any, str, statements.SessionQuoting]:
    """A connection with its vendor and its quoting probe."""
    return connection, connection.vendor, functools.partial(drivers.quoting, connection)


# Django's PostgreSQL backend's SAVEPOINT and RELEASE SAVEPOINT (its names
# are s<thread>_x<n>), and nothing else.
_DJANGO_SAVEPOINT = re.compile(r'SAVEPOINT "s\d+_x\d+"')
_DJANGO_RELEASE = re.compile(r'RELEASE SAVEPOINT "s\d+_x\d+"')


class _Savepoints:
    """The work's RELEASE SAVEPOINTs, without a round trip of their own.

    A ``transaction.atomic()`` block in the work is a savepoint, and its
    RELEASE only waits. Here it is held back and sent in front of the next
    statement, in the same simple query (psycopg 3's client-side cursors
    send several statements in one message and answer the last one's result
    once the others are skipped over); one still held when the work ends
    goes in front of the completion, so that a release the server refuses
    still fails the work. Every statement takes them in front, a ROLLBACK
    TO too: a release of a savepoint that the rollback would destroy may be
    one the server refuses (released twice, or rolled back past already),
    and that must fail the work as it would have. Releasing late changes
    nothing a statement can see. The
    SAVEPOINT itself is sent at once: a statement the library does not see
    (a cursor class instantiated by hand) must run after it. When it opens
    the transaction, it goes with the BEGIN (``postgresql.begin_with``).
    """

    def __init__(self) -> None:
        self.held: list[str] = []

    def hold(self, sql: Any, params: Any, many: bool) -> bool:
        """Whether ``sql`` is Django's RELEASE SAVEPOINT, held back."""
        if params is not None or many or not isinstance(sql, str):
            return False
        if _DJANGO_RELEASE.fullmatch(sql) is None:
            return False
        self.held.append(sql)
        return True

    def prefix(self, sql: Any, alone: bool) -> tuple[Any, list[str]]:
        """``sql`` with the held statements in front, and those statements
        (their results come first). SQL that must go ``alone`` (executemany,
        a cursor that binds on the server) and composed SQL take none, so
        ``flush`` sends those ahead."""
        if not self.held or alone or not isinstance(sql, str):
            return sql, []
        held, self.held = self.held, []
        return "; ".join([*held, sql]), held

    def flush(self, connection: Any) -> None:
        """Send what is held, alone: before SQL that cannot carry it."""
        if self.held:
            held, self.held = self.held, []
            try:
                send_alone(connection, held)
            except Exception as exc:
                _release_refused(held, exc)
                raise

    def create(self, connection: Any, sql: str) -> bool:
        """Send Django's SAVEPOINT ``sql`` at once, through libpq's own call:
        with the BEGIN when it opens the transaction, else behind what is
        held. False, sending nothing, where psycopg would send something of
        its own first (a BEGIN with an isolation level) or the transaction
        has failed (psycopg's own path then raises as it should)."""
        raw = connection.connection
        if not in_open_transaction(raw):
            return not self.held and begin_with(connection, sql)
        held, self.held = self.held, []
        try:
            send_at_once(connection, "; ".join([*held, sql]))
        except Exception as exc:
            self.failed_with(held, exc)
            raise
        return True

    def failed_with(self, held: list[str], exc: BaseException) -> None:
        """``held`` went in front of a statement that failed with ``exc``:
        given back if the server never answered, and a release it refused
        rolls the work back (``_release_refused``)."""
        if _refused_before_sending(exc):
            self.held[:0] = held  # still to send
        _release_refused(held, exc)


def send_alone(connection: Any, releases: list[str]) -> None:
    """Send held releases in a round trip of their own (one for them all
    where the driver takes several statements at once)."""
    with by_the_library(), connection.cursor() as cursor:
        for statement in ["; ".join(releases)] if sends_text(cursor.cursor) else releases:
            cursor.execute(statement)


# The work running in this context; None outside any work.
_work: contextvars.ContextVar[_WorkState | None] = contextvars.ContextVar(
    "idempotency_work", default=None
)
# Set while the library itself works inside the work (the retry-storm guard
# on a database cache): its statements are not the work's.
_suspended: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "idempotency_refusals_suspended", default=False
)


def _refuse(message: str) -> CannotBeAtomic:
    refusal = CannotBeAtomic(message)
    state = _work.get()
    if state is not None:
        state.refusals.append(refusal)
    return refusal


@contextlib.contextmanager
def confined(identity: Identity, using: str) -> Iterator[_WorkState]:
    """Run the body as work under ``identity``'s claim on ``using``, inside
    the transaction (or savepoint) that will also store its outcome. The
    state it yields holds, once the body is over, the releases not sent yet
    (``unsent_releases``)."""
    state = _WorkState(identity, using)
    reset = _work.set(state)
    # Each database's guard, pushed as Django's execute_wrapper() pushes it
    # (without a context manager for each: this runs on every request).
    guarded: list[tuple[str, Any, Callable[..., Any]]] = []
    restore_savepoints: Callable[[], None] | None = None
    taken_off: list[str] = []  # databases whose guard the work took off itself
    try:
        for alias in settings.DATABASES:
            guard = _guard(state, alias)
            connection = state.connection if alias == using else connections[alias]
            connection.execute_wrappers.append(guard)
            guarded.append((alias, connection, guard))
            if alias == using and state.savepoints is not None:
                restore_savepoints = _savepoints_without_cursors(state, guard)
        try:
            yield state
        except BaseException as exc:
            with contextlib.suppress(TransactionEnded):
                state.observe()
            if state.ended is not None:
                if exc is state.ended:
                    raise
                raise state.ended from exc
            refusals = state.refusals
            if isinstance(exc, RuntimeError) and refusals and exc not in refusals:
                raise refusals[0] from exc  # Django's own durable RuntimeError
            raise
        state.observe()
        if state.refusals:
            raise state.refusals[0]  # the work caught it and carried on: still no success
    finally:
        try:
            if restore_savepoints is not None:
                restore_savepoints()
        finally:
            for alias, connection, guard in reversed(guarded):
                if not _unguard(connection.execute_wrappers, guard):
                    taken_off.append(alias)
            _work.reset(reset)
            # Raised already if they count: kept, their tracebacks (which hold
            # frames holding this state) would make a reference cycle.
            state.refusals, state.ended = [], None
    if taken_off:  # the work succeeded, but nothing judged what it did after
        raise _refuse(
            f"The work under the idempotency key {identity.key!r} took the statement guard "
            f"off the execute wrappers of {', '.join(sorted(taken_off))}, so what it sent "
            "there afterwards cannot be known to commit with it. Push and pop only the "
            "wrappers the work adds itself (connection.execute_wrapper())."
        )


def _unguard(wrappers: list[Any], guard: Callable[..., Any]) -> bool:
    """Take ``guard`` off, and only it, whatever the work did to the list: a
    wrapper it pushed and never popped stays where it was (as it would
    without a key). A guard left on would judge every later statement of
    the thread as the work's. False when the work took it off already."""
    if wrappers and wrappers[-1] is guard:
        wrappers.pop()
    elif guard in wrappers:
        wrappers.remove(guard)
    else:
        return False
    return True


def rolled_back_by_the_server() -> bool:
    """Whether the server rolled the running work's transaction back (a
    deadlock) or refused a release the work held back, even if the work
    then told Django otherwise."""
    state = _work.get()
    return state is not None and state.rolled_back


@contextlib.contextmanager
def by_the_library() -> Iterator[None]:
    """The library's own statements inside the work (a database cache)."""
    reset = _suspended.set(True)
    try:
        yield
    finally:
        _suspended.reset(reset)


def _judged(
    state: _WorkState,
    alias: str,
    sql: Any,
    cursor: Any,
    run: Callable[[], Any],
    elsewhere: bool = False,
) -> Any:
    """Judge ``sql`` before ``run`` sends it to ``alias``: on the records'
    database, refuse what would start or end the work's transaction, ask
    the driver before and after whether it is still open, and mark the
    transaction for rollback when the statement fails; on any other, or
    through a connection to it other than the work's (``elsewhere``),
    refuse what is not a read."""
    _, vendor, quoting = state.database(alias)
    text = (
        sql
        if isinstance(sql, str)  # the ORM's, nearly always: no renderer to make
        else statements.as_text(sql, lambda composed: composed.as_string(cursor))
    )
    if alias != state.using or elsewhere:
        if text is None or not statements.is_read(text, vendor, quoting):
            raise _refuse(_not_a_read(state, alias, elsewhere))
        return run()
    state.observe()  # ended since the last statement, by a path no wrapper sees
    ending = None if text is None else statements.ends_transaction(text, vendor, quoting)
    if ending is not None:
        raise _refuse(_ends(ending))
    try:
        result = run()
    except Exception as exc:
        if isinstance(exc, DatabaseError):
            state.after_error(exc)
        with transaction.mark_for_rollback_on_error(alias):
            raise  # marked for rollback even if the work catches it
    state.observe()
    return result


def _guard(state: _WorkState, alias: str) -> Callable[..., Any]:
    """The execute wrapper of ``alias`` while the work runs."""

    savepoints = state.savepoints if alias == state.using else None

    def guard(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
        if _suspended.get():
            if savepoints is not None:
                savepoints.flush(context["connection"])
            return execute(sql, params, many, context)
        if savepoints is None or (params is not None and not savepoints.held):
            # Nothing to send in front of it, and (having parameters) neither
            # a release to hold nor a SAVEPOINT to send with the BEGIN: the
            # ORM's statements, nearly always.
            run = functools.partial(execute, sql, params, many, context)
        elif (reorder := _may_reorder(itself(), context["connection"])) and savepoints.hold(
            sql, params, many
        ):
            return context["cursor"].cursor  # what the driver's execute() returns
        else:
            run = functools.partial(
                _with_savepoints, state, execute, sql, params, many, context, reorder
            )
        state.judging = sql  # the raw cursor it reaches judges it no more
        try:
            return _judged(state, alias, sql, context["cursor"].cursor, run)
        finally:
            state.judging = None

    # Named through a weak reference: a guard that held itself would be a
    # reference cycle, and the work's whole state would wait in it for the
    # garbage collector after every request.
    itself = weakref.ref(guard)
    return guard


def _savepoints_without_cursors(state: _WorkState, guard: Callable[..., Any]) -> Callable[[], None]:
    """Until the function it returns is called (as the work ends), a
    ``transaction.atomic()`` block in the work opens its savepoint and
    holds its release without a cursor of Django's: making
    one and passing the statement through it costs several times what the
    guard then does with it (``_Savepoints``). Only where nobody could see
    the difference: the guard is the connection's one execute wrapper,
    Django makes cursors its own way and logs no queries, and no agent has
    replaced or wrapped ``CursorWrapper.execute`` or the driver cursor's
    ``execute`` (each would have seen the statement).
    Elsewhere, and for the library's own blocks, Django's methods run. The
    connection's ``_savepoint`` and ``_savepoint_commit`` are Django's
    private hooks, the same from 4.2 to 6.1 (``tests/lifecycle/
    test_savepoints_as_without_a_key.py`` fails if Django stops calling
    them)."""
    connection = state.connection
    savepoints = state.savepoints
    assert savepoints is not None
    django_create, django_release = connection._savepoint, connection._savepoint_commit

    def unseen() -> bool:
        wrappers = connection.execute_wrappers
        return (
            len(wrappers) == 1
            and wrappers[0] is guard
            and not _suspended.get()
            and sent_unseen(connection)
        )

    def create(sid: str) -> None:
        sql = connection.ops.savepoint_create_sql(sid)

        def send() -> bool:
            connection.validate_no_broken_transaction()  # as Django's cursor would
            return savepoints.create(connection, sql)

        if not unseen() or not _judged(state, state.using, sql, None, send):
            django_create(sid)

    def release(sid: str) -> None:
        if unseen():
            connection.validate_no_broken_transaction()
            if savepoints.hold(connection.ops.savepoint_commit_sql(sid), None, False):
                return
        django_release(sid)

    before = {name: vars(connection).get(name) for name in ("_savepoint", "_savepoint_commit")}
    connection._savepoint, connection._savepoint_commit = create, release

    def restore() -> None:
        for name, method in before.items():
            if method is None:
                vars(connection).pop(name, None)  # gone already if the work deleted it
            else:
                setattr(connection, name, method)

    return restore


def _may_reorder(guard: Callable[..., Any] | None, connection: Any) -> bool:
    """Whether the guard may hold a RELEASE back, or send a SAVEPOINT with
    the BEGIN, without anyone seeing a difference: no execute wrapper runs
    inside it (the work's own would miss the statement), and Django is not
    logging queries (its log reads the SQL back from the driver's cursor,
    and DEBUG, ``assertNumQueries`` and ``CaptureQueriesContext`` must show
    each statement as Django sent it)."""
    return connection.execute_wrappers[-1] is guard and not connection.queries_logged


def _with_savepoints(
    state: _WorkState,
    execute: Callable[..., Any],
    sql: Any,
    params: Any,
    many: bool,
    context: Any,
    reorder: bool,
) -> Any:
    """Run ``sql`` with the savepoint statements held in front of it (judged
    already: the driver's cursor it reaches need not judge it again), or,
    where the guard may not ``reorder``, after them."""
    savepoints = state.savepoints
    assert savepoints is not None
    # A cursor that binds on the server (the claim's, when it is prepared)
    # takes one statement: the held ones go ahead of it.
    alone = not reorder or many or not sends_text(context["cursor"].cursor)
    sent, held = savepoints.prefix(sql, alone)
    if not held:
        savepoints.flush(context["connection"])
        if (
            reorder
            and params is None
            and isinstance(sql, str)
            and _DJANGO_SAVEPOINT.fullmatch(sql)
            and sent_unseen(context["connection"])
            # the driver's own cursor in hand, not an agent's around it
            and type(context["cursor"].cursor) is context["connection"].connection.cursor_factory
            and begin_with(context["connection"], sql)
        ):
            return context["cursor"].cursor
        return execute(sql, params, many, context)
    state.judging = sent
    try:
        result = execute(sent, params, many, context)
    except Exception as exc:
        savepoints.failed_with(held, exc)
        raise
    for _ in held:
        context["cursor"].cursor.nextset()
    return result


# What the server answers a RELEASE or ROLLBACK TO of a savepoint it does not have.
INVALID_SAVEPOINT = "3B001"


def _release_refused(held: list[str], exc: BaseException) -> None:
    """After ``held`` releases went in front of a statement that failed. If
    the savepoint the server did not have is one they release (or its name
    cannot be read: a server speaking another language), the server refused
    one of them: without a key that release would have failed where it was
    called, while here the work may catch the error and heal the transaction
    with an enclosing block's rollback. The work is rolled back all the same
    (``WorkRolledBack``, 500 ``request_rolled_back``), as if it had not
    caught it. A savepoint of the statement's own is the statement's error."""
    state = _work.get()
    if state is None or not held or _sqlstate(exc) != INVALID_SAVEPOINT:
        return
    missing = _MISSING_SAVEPOINT.search(str(exc))
    if missing is None or any(f'"{missing.group(1)}"' in release for release in held):
        state.rolled_back = True


# The server's (English) message for a savepoint it does not have.
_MISSING_SAVEPOINT = re.compile(r'savepoint "([^"]*)" does not exist')


def _sqlstate(exc: BaseException) -> str | None:
    driver_error = exc if hasattr(exc, "sqlstate") else exc.__cause__
    return getattr(driver_error, "sqlstate", None)


def _refused_before_sending(exc: BaseException) -> bool:
    """Whether the server never answered the statement: an error without a
    server's SQLSTATE (a parameter the driver cannot adapt, a TypeError, a
    lost connection). Its held releases are put back: sent again after a
    lost connection, they fail as the transaction has; and one that did run
    is refused when sent again, which fails the work rather than let a
    refused release vanish."""
    return _sqlstate(exc) is None


def _ends(ending: str) -> str:
    if ending == statements.ENCODING_CHANGE:
        return (
            f"The work sent {ending}. The statement guard reads each statement in the "
            "character set Django's connection uses; in another (GBK, SJIS) a backslash "
            "can fall inside a character and a COMMIT hide in what looks like a string. "
            "Set the character set in DATABASES[...]['OPTIONS'], not inside idempotent work."
        )
    return (
        f"The work sent {ending}, which starts or ends the transaction that must also store "
        "its outcome (on MySQL, DDL, LOCK TABLES, CHECK and ANALYZE TABLE and SET autocommit "
        "commit it implicitly, and a procedure called with CALL, or a compound statement, may "
        "COMMIT): part of the work would commit without it, and run again on a retry. Run "
        "schema changes, stored procedures and transaction control outside idempotent work, "
        "or write the procedure's statements in the work itself."
    )


def _not_a_read(state: _WorkState, alias: str, elsewhere: bool = False) -> str:
    if elsewhere:
        return (
            f"Work under the idempotency key {state.identity.key!r} sent a statement that is "
            f"not a read to {alias!r} through another connection than the work's (a thread "
            "started with the work's context, by copy_context().run or "
            "sync_to_async(thread_sensitive=False), or a connection opened by hand): it would "
            "commit on its own, without the work's outcome, and run again on a retry. Write "
            "from the thread that runs the work, through Django's connection, or defer the "
            f"write with transaction.on_commit(..., using={alias!r}). (Reads there run.)"
        )
    return (
        f"Work under the idempotency key {state.identity.key!r} sent a statement to database "
        f"{alias!r} that is not a read, but its outcome is stored on {state.using!r}: the "
        "two cannot commit together, so a crash between them could run the work twice. Write "
        f"through {state.using!r}, set IDEMPOTENCY['DATABASE_ALIAS'] to the database the "
        f"work writes to, or defer the write with transaction.on_commit(..., "
        f"using={state.using!r}), which runs once the work has committed. (Reads are SELECT, "
        "VALUES, TABLE, SHOW, DESCRIBE, EXPLAIN, and WITH or COPY ... TO STDOUT that change "
        "nothing.)"
    )


# -- SQL sent through a driver's cursor, past Django's execute wrappers ------------


def guard_raw_cursors(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver: the cursors a PostgreSQL (psycopg 3)
    or MySQL (mysqlclient) connection makes judge what they run while work
    runs, as Django's execute wrappers do: ``execute()`` and
    ``executemany()`` reached past Django's cursor, psycopg's ``copy()`` and
    ``stream()``, mysqlclient's ``callproc()``."""
    raw = connection.connection
    if connection.vendor == "postgresql":
        factory = getattr(raw, "cursor_factory", None)
        if _guardable(factory) and hasattr(factory, "copy") and hasattr(factory, "stream"):
            raw.cursor_factory = _guarded_cursor(factory, connection.alias, _PSYCOPG_METHODS)
    elif connection.vendor == "mysql":
        factory = getattr(raw, "cursorclass", None)
        if _guardable(factory) and hasattr(factory, "callproc"):
            raw.cursorclass = _guarded_cursor(factory, connection.alias, _MYSQLDB_METHODS)


def _guardable(factory: Any) -> bool:
    """A cursor class not guarded yet: a pool (Django's ``OPTIONS["pool"]``)
    hands the same driver connection out again, its class as it was left,
    and Django sends ``connection_created`` on each checkout."""
    return factory is not None and GUARDED_CLASS not in getattr(factory, "__dict__", {})


# Each cursor method that runs SQL, and the SQL it runs from its arguments.
def _first(sql: Any, *args: Any, **kwargs: Any) -> Any:
    return sql


_PSYCOPG_METHODS = (
    ("execute", _first),
    ("executemany", _first),
    ("copy", _first),
    ("stream", _first),
)
_MYSQLDB_METHODS = (
    ("execute", _first),
    ("executemany", _first),
    ("callproc", lambda procname, *args, **kwargs: f"CALL {procname}"),
)


@functools.cache
def _guarded_cursor(
    base: type[Any], alias: str, methods: tuple[tuple[str, Callable[..., Any]], ...]
) -> type[Any]:
    def judging(name: str, sql_of: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Looked up per call: an agent may patch the driver's method later.
            original = getattr(base, name)
            state = _work.get()
            if state is None or _suspended.get():
                return original(self, *args, **kwargs)  # every statement outside work
            sql = sql_of(*args, **kwargs)
            # Asked even of the statement Django's wrapper is judging: a
            # wrapper of the work's may send it on another connection too,
            # or to another database, where it is judged again.
            elsewhere = alias == state.using and drivers.session(self.connection) != state.session
            if sql is state.judging and sql is not None and alias == state.using and not elsewhere:
                return original(self, *args, **kwargs)
            if state.savepoints is not None and alias == state.using and not elsewhere:
                state.savepoints.flush(state.connection)
            # Not the work's connection (``elsewhere``: another thread's, which
            # the work's context was copied to, or one opened by hand):
            # nothing it writes can commit with the work.
            call = functools.partial(original, self, *args, **kwargs)
            return _judged(state, alias, sql, self, call, elsewhere)

        return method

    namespace = {name: judging(name, sql_of) for name, sql_of in methods}
    return type(base.__name__, (base,), {**namespace, "__module__": __name__, GUARDED_CLASS: base})
