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
from collections.abc import Callable, Iterator
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.db.transaction import Atomic

from idempotency_app.exceptions import CannotBeAtomic, TransactionEnded
from idempotency_app.lifecycle import drivers, statements
from idempotency_app.store import Identity


class UnitAtomic(Atomic):
    """The transaction (or savepoint) holding the work and its outcome.

    Django refuses ``atomic(durable=True)`` directly inside another block by
    reading that block's ``_from_testcase`` (no public hook says a durable
    block was asked for; ``tests/test_work.py`` fails loudly if Django stops
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
        self.identity = identity
        self.using = using
        self.vendor = connections[using].vendor
        self.refusals: list[CannotBeAtomic] = []
        self.transaction_open = drivers.transaction_probe(connections[using])
        # The transaction has been seen open: seen closed from now on, it ended.
        self.started = False
        self.ended: TransactionEnded | None = None
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

    def after_error(self) -> None:
        """A failed statement that closed the transaction (a deadlock on
        MySQL) made the server roll it back: nothing of it committed, and
        the statements after it start anew."""
        if self.transaction_open is not None and self.transaction_open() is False:
            self.started = False


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
def confined(identity: Identity, using: str) -> Iterator[None]:
    """Run the body as work under ``identity``'s claim on ``using``, inside
    the transaction (or savepoint) that will also store its outcome."""
    state = _WorkState(identity, using)
    reset = _work.set(state)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(connections[using].execute_wrapper(_records_guard(state)))
            for alias in settings.DATABASES:
                if alias != using:
                    wrapper = _other_database_guard(state, alias)
                    stack.enter_context(connections[alias].execute_wrapper(wrapper))
            try:
                yield
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
        _work.reset(reset)


@contextlib.contextmanager
def by_the_library() -> Iterator[None]:
    """The library's own statements inside the work (a database cache)."""
    reset = _suspended.set(True)
    try:
        yield
    finally:
        _suspended.reset(reset)


def _text(sql: Any, context: dict[str, Any]) -> str | None:
    cursor = context["cursor"].cursor
    return statements.as_text(sql, lambda composed: composed.as_string(cursor))


def _records_guard(state: _WorkState) -> Callable[..., Any]:
    using, vendor = state.using, state.vendor

    def guard(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
        if _suspended.get():
            return execute(sql, params, many, context)
        state.observe()  # ended since the last statement, by a path no wrapper sees
        _refuse_ending(_text(sql, context), vendor)
        try:
            result = execute(sql, params, many, context)
        except Exception as exc:
            if isinstance(exc, DatabaseError):
                state.after_error()
            with transaction.mark_for_rollback_on_error(using):
                raise  # marked for rollback even if the work catches it
        state.observe()
        return result

    return guard


def _refuse_ending(text: str | None, vendor: str) -> None:
    """Refuse a statement that would start or end the work's transaction. A
    text the guard cannot read is left to the driver's report."""
    ending = None if text is None else statements.ends_transaction(text, vendor)
    if ending is not None:
        raise _refuse(
            f"The work sent {ending}, which starts or ends the transaction that must also "
            "store its outcome (on MySQL, DDL, LOCK TABLES, CHECK and ANALYZE TABLE and SET "
            "autocommit commit it implicitly, and a procedure called with CALL may COMMIT): "
            "part of the work would commit without it, and run again on a retry. Run schema "
            "changes, stored procedures and transaction control outside idempotent work, or "
            "write the procedure's statements in the work itself."
        )


def _other_database_guard(state: _WorkState, alias: str) -> Callable[..., Any]:
    vendor = connections[alias].vendor

    def guard(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
        if not _suspended.get():
            _refuse_unless_read(state, alias, _text(sql, context), vendor)
        return execute(sql, params, many, context)

    return guard


def _refuse_unless_read(state: _WorkState, alias: str, text: str | None, vendor: str) -> None:
    if text is not None and statements.is_read(text, vendor):
        return
    raise _refuse(
        f"Work under the idempotency key {state.identity.key!r} sent a statement to database "
        f"{alias!r} that is not a read, but its outcome is stored on {state.using!r}: the "
        "two cannot commit together, so a crash between them could run the work twice. Write "
        f"through {state.using!r}, set IDEMPOTENCY['DATABASE_ALIAS'] to the database the "
        f"work writes to, or defer the write with transaction.on_commit(..., "
        f"using={state.using!r}), which runs once the work has committed. (Reads are SELECT, "
        "VALUES, TABLE, SHOW, DESCRIBE, EXPLAIN, and WITH or COPY ... TO STDOUT that change "
        "nothing.)"
    )


def _judge(alias: str, sql: Any, cursor: Any) -> None:
    """Judge SQL that a raw cursor runs outside Django's execute wrappers."""
    state = _work.get()
    if state is None or _suspended.get():
        return
    text = statements.as_text(sql, lambda composed: composed.as_string(cursor))
    vendor = connections[alias].vendor
    if alias == state.using:
        state.observe()
        _refuse_ending(text, vendor)
    else:
        _refuse_unless_read(state, alias, text, vendor)


def guard_raw_cursors(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created`` receiver: psycopg 3 cursors whose ``copy()``
    and ``stream()``, which no execute wrapper sees, are judged like
    ``execute()`` while work runs."""
    if connection.vendor != "postgresql":
        return
    factory = getattr(connection.connection, "cursor_factory", None)
    if factory is not None and hasattr(factory, "copy") and hasattr(factory, "stream"):
        connection.connection.cursor_factory = _guarded_cursor(factory, connection.alias)


@functools.cache
def _guarded_cursor(base: type[Any], alias: str) -> type[Any]:
    def copy(self: Any, statement: Any, *args: Any, **kwargs: Any) -> Any:
        _judge(alias, statement, self)
        return base.copy(self, statement, *args, **kwargs)

    def stream(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        _judge(alias, query, self)
        return base.stream(self, query, *args, **kwargs)

    return type(base.__name__, (base,), {"copy": copy, "stream": stream, "__module__": __name__})
