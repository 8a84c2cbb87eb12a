"""What work under a claim may do to the database, enforced while it runs.

The work and its stored outcome must commit as one transaction on the
claim's database. Four things would break that, and each is stopped where it
happens rather than discovered later:

- a write to another database, which would commit on its own;
- ``transaction.atomic(durable=True)``, which would commit on its own;
- a statement that ends the transaction (``COMMIT``, or on MySQL any DDL,
  which commits implicitly, ``SET autocommit``, and ``CALL``, since a
  procedure may ``COMMIT`` inside), which would commit part of the work;
- a database error the work catches and carries on after: Django marks the
  transaction for rollback when an ORM write fails, not when a read such as
  ``select_for_update`` does, while MySQL has already rolled the whole
  transaction back (a deadlock). Every failed statement marks it here, so
  the work's success is reported as rolled back, never stored.

The first three raise ``CannotBeAtomic`` before anything runs, and are
remembered: work that catches the refusal still fails.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator
from typing import Any

from django.conf import settings
from django.db import connections, transaction
from django.db.transaction import Atomic

from idempotency_app.store import Identity


class CannotBeAtomic(RuntimeError):
    """The work did something that cannot commit together with its stored
    outcome; it was stopped and rolled back. The message names the fix."""


# Statements that do not change data: reads, locks and savepoints.
_READ_ONLY = frozenset(
    {
        *("SELECT", "SHOW", "EXPLAIN", "DESCRIBE", "DESC", "VALUES", "PRAGMA", "SET"),
        *("SAVEPOINT", "RELEASE", "ROLLBACK", "BEGIN", "START", "COMMIT"),
    }
)
_WRITE_IN_CTE = re.compile(r"\b(INSERT|UPDATE|DELETE|MERGE)\b", re.IGNORECASE)
# Statements that end the current transaction; on MySQL, DDL and a few
# others commit it implicitly.
_ENDS_TRANSACTION = frozenset(("COMMIT", "BEGIN", "START", "END", "ABORT"))
# MySQL's executable comments: "/*!50000 ... */" and MariaDB's "/*M!100500 ... */"
# hold SQL that runs; only their marker and version are skipped.
_MYSQL_EXECUTABLE_COMMENT = re.compile(r"/\*M?!\d*")
# The first two words; "/*!COMMIT*/" is the word COMMIT.
_FIRST_WORDS = re.compile(r"\W*(\w+)(?:\W+(\w+))?")
_MYSQL_IMPLICIT_COMMIT = frozenset(
    {
        *("CREATE", "ALTER", "DROP", "TRUNCATE", "RENAME", "LOCK", "UNLOCK", "GRANT"),
        *("REVOKE", "ANALYZE", "OPTIMIZE", "REPAIR", "FLUSH", "INSTALL", "UNINSTALL"),
    }
)

# The refusals of the work running in this context; None outside any work.
_refusals: contextvars.ContextVar[list[CannotBeAtomic] | None] = contextvars.ContextVar(
    "idempotency_refusals", default=None
)
# Set while the library itself works inside the work (the retry-storm guard
# on a database cache): its statements are not the work's.
_suspended: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "idempotency_refusals_suspended", default=False
)


class UnitAtomic(Atomic):
    """The transaction (or savepoint) holding the work and its outcome.

    Django refuses ``atomic(durable=True)`` directly inside another block by
    reading that block's ``_from_testcase``; reading ours records the
    refusal, so work that swallows Django's RuntimeError still fails.
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


def _refuse(message: str) -> CannotBeAtomic:
    refusal = CannotBeAtomic(message)
    refusals = _refusals.get()
    if refusals is not None:
        refusals.append(refusal)
    return refusal


@contextlib.contextmanager
def confined(identity: Identity, using: str) -> Iterator[None]:
    """Run the body as work under ``identity``'s claim on ``using``."""
    refusals: list[CannotBeAtomic] = []
    reset = _refusals.set(refusals)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(connections[using].execute_wrapper(_records_guard(using)))
            for alias in settings.DATABASES:
                if alias != using:
                    wrapper = _other_database_guard(identity, using)
                    stack.enter_context(connections[alias].execute_wrapper(wrapper))
            try:
                yield
            except RuntimeError as exc:
                if refusals and not isinstance(exc, CannotBeAtomic):
                    raise refusals[0] from exc  # Django's own durable RuntimeError
                raise
            if refusals:
                raise refusals[0]  # the work caught it and carried on: still no success
    finally:
        _refusals.reset(reset)


@contextlib.contextmanager
def by_the_library() -> Iterator[None]:
    """The library's own statements inside the work (a database cache)."""
    reset = _suspended.set(True)
    try:
        yield
    finally:
        _suspended.reset(reset)


def _verb(sql: Any, context: dict[str, Any]) -> tuple[str, str]:
    """The statement's first two words, upper-cased, after any comments."""
    if not isinstance(sql, str):
        try:  # a psycopg sql.Composed
            sql = sql.as_string(context["cursor"].cursor)
        except Exception:
            sql = "?"
    start = _statement_start(sql, context["connection"].vendor)
    words = _FIRST_WORDS.match(sql, start)
    if words is None:
        return "", ""
    first, second = words.groups()
    return first.upper(), (second or "").upper()


def _statement_start(sql: str, vendor: str) -> int:
    """Where the statement's first word is, past whitespace, parentheses and
    comments as the database reads them: "--" lines, "/* */" blocks (nested
    on PostgreSQL), "#" lines and executable comments on MySQL."""
    i, n = 0, len(sql)
    while i < n:
        if sql[i] in " \t\r\n(":
            i += 1
        elif sql.startswith("--", i) or (vendor == "mysql" and sql[i] == "#"):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif vendor == "mysql" and (executable := _MYSQL_EXECUTABLE_COMMENT.match(sql, i)):
            i = executable.end()
        elif sql.startswith("/*", i):
            i = _comment_end(sql, i, nested=vendor == "postgresql")
        else:
            break
    return i


def _comment_end(sql: str, start: int, nested: bool) -> int:
    """The index after the block comment opened at ``start``."""
    depth, i = 1, start + 2
    while depth:
        close = sql.find("*/", i)
        if close < 0:
            return len(sql)
        opening = sql.find("/*", i, close) if nested else -1
        if opening >= 0:
            depth, i = depth + 1, opening + 2
        else:
            depth, i = depth - 1, close + 2
    return i


def _records_guard(using: str) -> Callable[..., Any]:
    vendor = connections[using].vendor

    def guard(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
        if _suspended.get():
            return execute(sql, params, many, context)
        verb, second = _verb(sql, context)
        ends = verb in _ENDS_TRANSACTION or (verb == "ROLLBACK" and second != "TO")
        if vendor == "mysql" and (
            (verb in _MYSQL_IMPLICIT_COMMIT and second != "TEMPORARY")
            or verb == "CALL"
            or (verb == "SET" and "AUTOCOMMIT" in str(sql).upper())
        ):
            ends = True
        if ends:
            raise _refuse(
                f"The work sent {verb}, which ends the transaction that must also store its "
                "outcome (on MySQL, DDL, LOCK TABLES and SET autocommit commit it implicitly, "
                "and a procedure called with CALL may COMMIT): part of the work would commit "
                "without it, and run again on a retry. Run schema changes, stored procedures "
                "and transaction control outside idempotent work, or write the procedure's "
                "statements in the work itself."
            )
        with transaction.mark_for_rollback_on_error(using):
            return execute(sql, params, many, context)

    return guard


def _other_database_guard(identity: Identity, using: str) -> Callable[..., Any]:
    def guard(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
        if _suspended.get():
            return execute(sql, params, many, context)
        verb, _ = _verb(sql, context)
        reads = verb in _READ_ONLY or (verb == "WITH" and not _WRITE_IN_CTE.search(str(sql)))
        if not reads:
            alias = context["connection"].alias
            raise _refuse(
                f"Work under the idempotency key {identity.key!r} tried to write to database "
                f"{alias!r}, but its outcome is stored on {using!r}: the two cannot commit "
                "together, so a crash between them could run the work twice. Write through "
                f"{using!r}, set IDEMPOTENCY['DATABASE_ALIAS'] to the database the work writes "
                f"to, or defer the write with transaction.on_commit(..., using={using!r}), "
                "which runs once the work has committed."
            )
        return execute(sql, params, many, context)

    return guard
