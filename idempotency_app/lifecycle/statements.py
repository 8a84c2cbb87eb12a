"""SQL text read as the database reads it, and judged by two rules.

The statement guard (``work``) asks two questions of the SQL that idempotent
work sends:

- on the records' database, ``ends_transaction``: does any statement in the
  text start or end a transaction (on MySQL, commit it implicitly)? Then
  part of the work would commit without its stored outcome.
- on any other database, ``is_read``: is every statement in the text a read?
  Anything else would commit on its own.

Both read the text with a small lexer per vendor: string literals (with or
without backslash escapes), quoted identifiers, PostgreSQL's dollar quotes
and nested comments, MySQL's ``#`` comments, ``--`` comments as each vendor
ends them, MySQL's executable comments (``/*! ... */``, ``/*M! ... */``, whose
SQL runs) and ``;`` between statements. Every statement of a multi-statement
text is judged. Where a server setting changes how quotes read
(``NO_BACKSLASH_ESCAPES`` and ``ANSI_QUOTES`` on MySQL,
``standard_conforming_strings`` on PostgreSQL), the text is read every way
the setting allows and judged by the strictest reading.

A text the lexer need not read takes a fast path: one statement (no ``;``
anywhere) whose first word alone decides, as every statement Django's ORM
writes does. Measured in ``benchmarks/statement_guard.py``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

# -- tokens --------------------------------------------------------------------

WORD, QUOTED, VARIABLE, PUNCT = "word", "quoted", "variable", "punct"


class Token(NamedTuple):
    kind: str
    # A word upper-cased; a quoted token's content; punctuation as written.
    text: str
    # How many parentheses are open around it.
    depth: int


Statement = list[Token]


@dataclass(frozen=True)
class Reading:
    """One way a vendor's server may read quotes."""

    vendor: str
    # Whether a backslash escapes the next character in '...' strings.
    backslash: bool
    # On MySQL: whether "..." is an identifier (ANSI_QUOTES), so a backslash
    # does not escape inside it.
    ansi_quotes: bool = False


READINGS: dict[str, tuple[Reading, ...]] = {
    "postgresql": (
        Reading("postgresql", backslash=False),  # standard_conforming_strings = on
        Reading("postgresql", backslash=True),
    ),
    "mysql": (
        Reading("mysql", backslash=True),  # the default SQL mode
        Reading("mysql", backslash=False),  # NO_BACKSLASH_ESCAPES
        Reading("mysql", backslash=True, ansi_quotes=True),
    ),
    "sqlite": (Reading("sqlite", backslash=False),),
}


def _quoted(quote: str, backslash: bool) -> str:
    """A literal opened by ``quote``, closed by it (doubled inside), or
    running to the end of the text when unterminated."""
    q = re.escape(quote)
    body = rf"[^{q}\\]|\\(?:.|\Z)|{q}{q}" if backslash else rf"[^{q}]|{q}{q}"
    return rf"{q}(?:{body})*(?:{q}|\Z)"


@functools.cache
def _token_pattern(reading: Reading) -> re.Pattern[str]:
    vendor = reading.vendor
    quoted = [_quoted("'", reading.backslash)]
    if vendor == "postgresql":
        quoted.insert(0, "[eE]" + _quoted("'", True))  # E'...' always escapes
        quoted.append(_quoted('"', False))
    elif vendor == "mysql":
        quoted.append(_quoted('"', reading.backslash and not reading.ansi_quotes))
        quoted.append(_quoted("`", False))
    else:
        quoted += [_quoted('"', False), _quoted("`", False), r"\[[^\]]*(?:\]|\Z)"]
    line_comment = {
        "postgresql": r"--[^\n\r]*",
        # MySQL: "--" starts a comment only before whitespace or a control
        # character ("1--1" is arithmetic); "#" starts one too.
        "mysql": r"--(?=[\x00-\x20]|\Z)[^\n]*|\#[^\n]*",
        "sqlite": r"--[^\n]*",
    }[vendor]
    parts = [
        rf"(?P<space>{line_comment}|\Z)",
        r"(?P<block>/\*)",
        rf"(?P<quoted>{'|'.join(quoted)})",
    ]
    if vendor == "mysql":
        parts.append(r"(?P<sysvar>@@)")
        parts.append(r"(?P<variable>@(?:[\w$.]+|" + "|".join(quoted) + "))")
    if vendor == "postgresql":
        parts.append(r"(?P<dollar>\$(?:[^\W\d]\w*)?\$)")
    parts += [
        r"(?P<word>[^\W\d][\w$]*)",
        r"(?P<number>\d[\w$.]*|\.\d[\w$]*)",
        r"(?P<punct>.)",
    ]
    # Whitespace goes with the token after it: half as many matches.
    return re.compile(r"\s*(?:" + "|".join(parts) + ")", re.DOTALL)


_EXECUTABLE_COMMENT = re.compile(r"/\*M?!\d*")


def _block_end(sql: str, start: int, nested: bool) -> int:
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


def tokens(sql: str, reading: Reading) -> Iterator[Token]:
    """The text's tokens, comments and whitespace left out."""
    pattern = _token_pattern(reading)
    mysql = reading.vendor == "mysql"
    depth, i, n = 0, 0, len(sql)
    executable = False  # inside MySQL's /*! ... */, whose SQL runs
    while i < n:
        match = pattern.match(sql, i)
        assert match is not None and match.lastgroup is not None  # "punct" matches anything
        kind, i = match.lastgroup, match.end()
        if kind == "space" or kind == "number":
            continue
        start = match.start(kind)
        text = sql[start:i]
        if kind == "block":
            opening = _EXECUTABLE_COMMENT.match(sql, start) if mysql else None
            if opening is not None and not executable:
                executable, i = True, opening.end()
            else:
                i = _block_end(sql, start, nested=reading.vendor == "postgresql")
            continue
        if executable and text == "*" and sql.startswith("/", i):
            executable, i = False, i + 1
        elif kind == "word":
            yield Token(WORD, text.upper(), depth)
        elif kind == "quoted":
            yield Token(QUOTED, _content(text), depth)
        elif kind == "dollar":
            close = sql.find(text, i)
            end = n if close < 0 else close
            yield Token(QUOTED, sql[i:end], depth)
            i = n if close < 0 else close + len(text)
        elif kind == "variable":
            yield Token(VARIABLE, text, depth)
        elif text == "(":
            yield Token(PUNCT, text, depth)
            depth += 1
        elif text == ")":
            depth = max(0, depth - 1)
            yield Token(PUNCT, text, depth)
        elif text == ";":
            depth = 0  # a statement's unbalanced parentheses end with it
            yield Token(PUNCT, text, depth)
        else:
            yield Token(PUNCT, text, depth)


def _content(literal: str) -> str:
    """What a quoted token holds, without its prefix and quotes; escapes stay
    as written (a statement inside is judged by its words)."""
    if literal[:1] in "eE" and literal[1:2] == "'":
        literal = literal[1:]
    closing = {"[": "]"}.get(literal[0], literal[0])
    end = -1 if len(literal) > 1 and literal.endswith(closing) else len(literal)
    return literal[1:end]


def split(sql: str, reading: Reading) -> list[Statement]:
    """The text's statements, each a list of tokens; empty ones left out."""
    statements: list[Statement] = []
    current: Statement = []
    for token in tokens(sql, reading):
        if token.kind == PUNCT and token.text == ";":
            if current:
                statements.append(current)
            current = []
        else:
            current.append(token)
    if current:
        statements.append(current)
    return statements


def _words(statement: Statement) -> list[str]:
    return [t.text for t in statement if t.kind == WORD]


# -- what ends the transaction ---------------------------------------------------

# Statements that start or end a transaction, on every vendor. (PostgreSQL
# only warns at a BEGIN inside a transaction, but work that sends one means
# to manage its own transaction, which cannot hold inside idempotent work.)
_TRANSACTION_CONTROL = frozenset({"BEGIN", "START", "COMMIT", "END", "ROLLBACK", "ABORT"})
# MySQL and MariaDB commit the transaction implicitly before these (their
# manuals' "Statements That Cause an Implicit Commit"). CREATE and DROP of a
# TEMPORARY table do not; ANALYZE, CHECK and LOAD do only in the forms
# handled below. CALL is here because a procedure may COMMIT.
_MYSQL_IMPLICIT_COMMIT = frozenset(
    {
        *("ALTER", "CREATE", "DROP", "RENAME", "TRUNCATE", "GRANT", "REVOKE", "LOCK"),
        *("UNLOCK", "OPTIMIZE", "REPAIR", "FLUSH", "RESET", "CACHE", "INSTALL"),
        *("UNINSTALL", "SHUTDOWN", "CHANGE", "STOP", "XA", "BACKUP", "CALL"),
    }
)
# What follows ANALYZE or CHECK in MySQL's table maintenance statements.
_TABLE_FORMS = frozenset({"TABLE", "TABLES", "VIEW", "NO_WRITE_TO_BINLOG", "LOCAL", "PERSISTENT"})
# The statements an ANALYZE, EXPLAIN or SET STATEMENT ... FOR may carry.
_STATEMENT_STARTS = frozenset(
    {"SELECT", "INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "WITH", "VALUES", "TABLE"}
)


def _rest_from(statement: Statement, index: int) -> Statement:
    return statement[index:]


def _inner_statement(statement: Statement, after: int) -> Statement | None:
    """The statement an EXPLAIN/ANALYZE/SET STATEMENT carries: from the first
    word at the outer level, after ``after``, that can start one."""
    for index in range(after, len(statement)):
        token = statement[index]
        if token.kind == WORD and token.depth == 0 and token.text in _STATEMENT_STARTS:
            return _rest_from(statement, index)
    return None


def _ending(statement: Statement, reading: Reading) -> str | None:
    """The words that end (or may end) the transaction, or None."""
    words = _words(statement)
    if not words:
        return None
    first = words[0]
    second = words[1] if len(words) > 1 else ""
    if first == "ROLLBACK" and "TO" in words[1:3]:
        return None  # ROLLBACK [WORK | TRANSACTION] TO [SAVEPOINT] name
    if first in _TRANSACTION_CONTROL:
        return first
    vendor = reading.vendor
    if vendor == "postgresql" and first == "PREPARE" and second == "TRANSACTION":
        return "PREPARE TRANSACTION"
    if vendor != "mysql":
        return None
    if first in ("CREATE", "DROP") and "TEMPORARY" in words[1:4]:
        return None
    if first in _MYSQL_IMPLICIT_COMMIT:
        return first
    if first in ("ANALYZE", "CHECK"):
        inner = None if second in _TABLE_FORMS else _inner_statement(statement, 1)
        if inner is None:
            return f"{first} {second}".strip()  # ANALYZE TABLE, CHECK TABLE, CHECK VIEW
        return _ending(inner, reading)  # MariaDB's ANALYZE SELECT runs the SELECT
    if first == "LOAD" and second == "INDEX":
        return "LOAD INDEX"
    if first == "SET":
        if second == "PASSWORD":
            return "SET PASSWORD"
        if "AUTOCOMMIT" in words:  # @@autocommit, SESSION autocommit, not @autocommit
            return "SET autocommit"
        if second == "STATEMENT":
            inner = _inner_statement(statement, 2)
            return None if inner is None else _ending(inner, reading)
        return None
    if first == "EXECUTE" and second == "IMMEDIATE":
        return _ending_in_literal(statement, reading, "EXECUTE IMMEDIATE")
    if first == "PREPARE":
        return _ending_in_literal(statement, reading, "PREPARE")
    return None


def _ending_in_literal(statement: Statement, reading: Reading, what: str) -> str | None:
    """MySQL's EXECUTE IMMEDIATE '...' and PREPARE s FROM '...' run the SQL
    in a literal: judge it. From a variable, it cannot be read here."""
    literals = [t.text for t in statement if t.kind == QUOTED and t.depth == 0]
    if len(literals) != 1 or any(t.kind == VARIABLE for t in statement):
        return f"{what} of SQL the guard cannot read"
    for inner in split(literals[-1], reading):
        ending = _ending(inner, reading)
        if ending is not None:
            return ending
    return None


# -- what counts as a read ---------------------------------------------------------

# Statements that begin a read. WITH is a read only when its main statement
# and every statement in it are.
_READ_STARTS = frozenset({"SELECT", "VALUES", "TABLE", "SHOW", "WITH", "DESCRIBE", "DESC"})
# Statements that change no data: transaction control and session settings.
# Writes are refused, so a COMMIT on another database has nothing to commit.
_NO_DATA = frozenset(
    {"BEGIN", "START", "COMMIT", "END", "ROLLBACK", "ABORT", "SAVEPOINT", "RELEASE", "SET"}
)
# Statements that change data, wherever they start: at the beginning, or
# after "(" (a data-modifying CTE, a subquery).
_WRITES = frozenset(
    {"INSERT", "UPDATE", "DELETE", "MERGE", "REPLACE", "UPSERT", "COPY", "CALL", "DO"}
)


def _is_read(statement: Statement, reading: Reading) -> bool:
    words = [t for t in statement if t.kind == WORD]
    if not words:
        return True
    first = words[0].text
    if first in _NO_DATA:
        return not (first == "SET" and _second(words) == "PASSWORD")
    if first in ("EXPLAIN", "DESCRIBE", "DESC") and _second(words) != "":
        return _explained_is_read(statement, reading)
    if first == "ANALYZE" and reading.vendor == "mysql":
        # MariaDB's ANALYZE <statement> runs it; ANALYZE TABLE writes statistics.
        inner = None if _second(words) in _TABLE_FORMS else _inner_statement(statement, 1)
        return inner is not None and _is_read(inner, reading)
    if first == "COPY":
        return _copies_out(statement, reading)
    if first == "PRAGMA":
        return _pragma_asks(statement)
    if first not in _READ_STARTS and not (statement[0].kind == PUNCT and statement[0].text == "("):
        return False
    return not _writes_inside(statement, reading)


def _copies_out(statement: Statement, reading: Reading) -> bool:
    """PostgreSQL's COPY ... TO STDOUT reads (a query's rows, or a table's);
    COPY ... FROM writes, and COPY ... TO a file or program acts outside."""
    outer = [t.text for t in statement if t.kind == WORD and t.depth == 0]
    if "FROM" in outer or "TO" not in outer:
        return False
    following = outer[outer.index("TO") + 1 : outer.index("TO") + 2]
    return following == ["STDOUT"] and not _writes_inside(statement[1:], reading)


# SQLite pragmas that take an argument in parentheses only to ask about it
# (the same form sets others: journal_mode(WAL)), and those that act unasked.
_ASKING_PRAGMAS = frozenset(
    {
        *("TABLE_INFO", "TABLE_XINFO", "TABLE_LIST", "INDEX_LIST", "INDEX_INFO"),
        *("INDEX_XINFO", "FOREIGN_KEY_LIST", "FOREIGN_KEY_CHECK", "INTEGRITY_CHECK"),
        "QUICK_CHECK",
    }
)
_ACTING_PRAGMAS = frozenset({"OPTIMIZE", "INCREMENTAL_VACUUM", "WAL_CHECKPOINT", "SHRINK_MEMORY"})


def _pragma_asks(statement: Statement) -> bool:
    """A PRAGMA that sets nothing: no "=", and either no argument (unless it
    acts by itself) or an argument to a pragma that only asks."""
    if any(t.kind == PUNCT and t.text == "=" for t in statement):
        return False
    names = [t for t in statement if t.kind == WORD and t.depth == 0]
    name = names[-1].text if names else ""
    if any(t.kind == PUNCT and t.text == "(" for t in statement):
        return name in _ASKING_PRAGMAS
    return name not in _ACTING_PRAGMAS


def _second(words: list[Token]) -> str:
    return words[1].text if len(words) > 1 else ""


def _writes_inside(statement: Statement, reading: Reading) -> bool:
    """A data-changing statement anywhere in a read: a CTE's, a subquery's,
    or the main statement after WITH's list; or SELECT ... INTO, which makes
    a table on PostgreSQL and a file on MySQL (INTO @variable is a read)."""
    previous: Token | None = None
    main = None
    for index, token in enumerate(statement):
        if token.kind == WORD:
            starts = previous is None or (previous.kind == PUNCT and previous.text == "(")
            if starts and token.text in _WRITES:
                return True
            if token.depth == 0 and main is None and token.text in _STATEMENT_STARTS - {"WITH"}:
                main = token.text
            if (
                token.text == "INTO"
                and token.depth == 0
                and _into_writes(statement, index, reading)
            ):
                return True
        previous = token
    return main is not None and main in _WRITES


def _into_writes(statement: Statement, index: int, reading: Reading) -> bool:
    if reading.vendor == "postgresql":
        return True
    following = statement[index + 1] if index + 1 < len(statement) else None
    return (
        following is not None
        and following.kind == WORD
        and following.text
        in (
            "OUTFILE",
            "DUMPFILE",
        )
    )


def _explained_is_read(statement: Statement, reading: Reading) -> bool:
    """EXPLAIN only plans a statement, unless it ANALYZEs it (PostgreSQL's
    EXPLAIN ANALYZE and MySQL's run it): then the statement decides."""
    inner = _inner_statement(statement, 1)
    if inner is None:
        return True  # DESCRIBE table, EXPLAIN FOR CONNECTION, SQLite's QUERY PLAN ...
    options = statement[: len(statement) - len(inner)]
    if not any(t.kind == WORD and t.text == "ANALYZE" for t in options):
        return True
    return _is_read(inner, reading)


# -- the two questions ------------------------------------------------------------

_FIRST_WORD = re.compile(r"\s*([A-Za-z]+)\b")
# One statement whose first word alone says it ends no transaction.
_FAST_KEEPS_TRANSACTION = frozenset(
    {"SELECT", "INSERT", "UPDATE", "DELETE", "SAVEPOINT", "RELEASE"}
)
# One statement whose first word alone says it is a read (SELECT ... INTO
# aside, which the lexer reads).
_FAST_READ = frozenset({"SELECT", "SAVEPOINT", "RELEASE"})
_INTO = re.compile("into", re.IGNORECASE)


def _fast_word(sql: str) -> str | None:
    if ";" in sql:
        return None
    match = _FIRST_WORD.match(sql)
    return match.group(1).upper() if match else None


def ends_transaction(sql: str, vendor: str) -> str | None:
    """What in ``sql`` starts or ends the transaction it runs in (on MySQL,
    commits it implicitly), or None when nothing does, however the server's
    settings read its quotes."""
    if _fast_word(sql) in _FAST_KEEPS_TRANSACTION:
        return None
    for reading in _readings(sql, vendor):
        for statement in split(sql, reading):
            ending = _ending(statement, reading)
            if ending is not None:
                return ending
    return None


def is_read(sql: str, vendor: str) -> bool:
    """Whether every statement in ``sql`` only reads, however the server's
    settings read its quotes.

    The rule: a statement is a read when it starts with SELECT, VALUES,
    TABLE, SHOW, DESCRIBE, EXPLAIN (unless it analyzes a statement that is
    not a read), WITH or a parenthesis, and nothing in it starts a statement
    that changes data (INSERT, UPDATE, DELETE, MERGE, REPLACE, COPY, CALL,
    DO) nor selects INTO a table or file; or when it changes no data
    (transaction control, savepoints, SET, a PRAGMA that only asks). Any
    other statement is not a read, whatever it is.
    """
    if _fast_word(sql) in _FAST_READ and not _INTO.search(sql):
        return True
    return all(
        _is_read(statement, reading)
        for reading in _readings(sql, vendor)
        for statement in split(sql, reading)
    )


def _readings(sql: str, vendor: str) -> tuple[Reading, ...]:
    """The readings that may differ for this text: without a backslash in
    it, every reading of a vendor's quotes tokenizes it alike."""
    readings = READINGS[vendor]
    return readings if "\\" in sql else readings[:1]


def as_text(sql: object, render: Callable[[Any], str] | None = None) -> str | None:
    """The SQL a driver will send, as text: bytes decoded as UTF-8 (ASCII,
    which every keyword is, survives any decoding), a psycopg ``sql``
    object rendered with ``render``; None when it cannot be read."""
    if isinstance(sql, str):
        return sql
    if isinstance(sql, (bytes, bytearray, memoryview)):
        return bytes(sql).decode("utf-8", "surrogateescape")
    if render is not None:
        try:
            return render(sql)
        except Exception:
            return None
    return None
