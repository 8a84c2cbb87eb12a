"""SQL text read as the database reads it, and judged by two rules.

The statement guard (``work``) asks two questions of the SQL that idempotent
work sends:

- on the records' database, ``ends_transaction``: does any statement in the
  text start or end a transaction (on MySQL, commit it implicitly, or run a
  compound statement that may)? Then part of the work would commit without
  its stored outcome.
- on any other database, ``is_read``: is every statement in the text a read?
  Anything else would commit on its own.

Both read the text with a small lexer per vendor: string literals (with or
without backslash escapes), quoted identifiers, PostgreSQL's dollar quotes
and nested comments, MySQL's ``#`` comments, ``--`` comments as each vendor
ends them, MySQL's executable comments (``/*! ... */``, whose SQL runs, and
the conditional ``/*!50700 ... */`` and ``/*M! ... */``, which run on some
servers only) and ``;`` between statements. Every statement of a
multi-statement text is judged, and statements that carry another (``SET
STATEMENT ... FOR``, ``EXPLAIN``, MariaDB's ``ANALYZE``, ``EXECUTE
IMMEDIATE``) are judged by what they carry. Where the reading depends on the
server (its quoting settings, unless the driver reports them; whether it
runs a conditional comment), the text is read every way it may be and
judged by the strictest reading.

A text the lexer need not read takes a fast path: one statement (no ``;``
anywhere) whose first word alone decides, as every statement Django's ORM
writes does. Measured in ``benchmarks/statement_guard.py``.
"""

from __future__ import annotations

import functools
import itertools
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
class Quoting:
    """How a server session reads quotes."""

    # Whether a backslash escapes the next character in '...' strings
    # (MySQL without NO_BACKSLASH_ESCAPES; PostgreSQL with
    # standard_conforming_strings off).
    backslash: bool
    # On MySQL: whether "..." is an identifier (ANSI_QUOTES), so a backslash
    # does not escape inside it.
    ansi_quotes: bool = False


@dataclass(frozen=True)
class Reading:
    """One way a server may read a text."""

    vendor: str
    quoting: Quoting
    # On MySQL: whether the conditional executable comments (/*!NNNNN ...*/,
    # /*M! ... */) run. Which do depends on the server's make and version.
    conditional_comments_run: bool = True


QUOTINGS: dict[str, tuple[Quoting, ...]] = {
    "postgresql": (Quoting(backslash=False), Quoting(backslash=True)),
    "mysql": (
        Quoting(backslash=True),  # the default SQL mode
        Quoting(backslash=False),  # NO_BACKSLASH_ESCAPES
        Quoting(backslash=True, ansi_quotes=True),
    ),
    "sqlite": (Quoting(backslash=False),),
}


def _quoted(quote: str, backslash: bool) -> str:
    """A literal opened by ``quote``, closed by it (doubled inside), or
    running to the end of the text when unterminated."""
    q = re.escape(quote)
    body = rf"[^{q}\\]|\\(?:.|\Z)|{q}{q}" if backslash else rf"[^{q}]|{q}{q}"
    return rf"{q}(?:{body})*(?:{q}|\Z)"


@functools.cache
def _token_pattern(vendor: str, quoting: Quoting) -> re.Pattern[str]:
    quoted = [_quoted("'", quoting.backslash)]
    if vendor == "postgresql":
        quoted.insert(0, "[eE]" + _quoted("'", True))  # E'...' always escapes
        quoted.append(_quoted('"', False))
    elif vendor == "mysql":
        quoted.append(_quoted('"', quoting.backslash and not quoting.ansi_quotes))
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


# MySQL's executable comments: /*!...*/ runs everywhere; /*!NNNNN ...*/ only
# on servers whose version is at least NNNNN (MariaDB skips 5.7 and later
# MySQL versions), /*M!...*/ only on MariaDB.
_EXECUTABLE_COMMENT = re.compile(r"/\*(M?)!(\d*)")


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
    pattern = _token_pattern(reading.vendor, reading.quoting)
    mysql = reading.vendor == "mysql"
    depth, i, n = 0, 0, len(sql)
    executable = False  # inside an executable comment that runs
    while i < n:
        match = pattern.match(sql, i)
        assert match is not None and match.lastgroup is not None  # "punct" matches anything
        kind, i = match.lastgroup, match.end()
        if kind == "space" or kind == "number":
            continue
        start = match.start(kind)
        text = sql[start:i]
        if kind == "block":
            opening = _EXECUTABLE_COMMENT.match(sql, start) if mysql and not executable else None
            conditional = opening is not None and bool(opening.group(1) or opening.group(2))
            if opening is not None and (reading.conditional_comments_run or not conditional):
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


# -- statements that carry another ------------------------------------------------

# The statements an EXPLAIN, an ANALYZE or a SET STATEMENT ... FOR may carry.
_STATEMENT_STARTS = frozenset(
    {"SELECT", "INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "WITH", "VALUES", "TABLE"}
)
# EXPLAIN's and MariaDB ANALYZE's options before the statement they carry.
_EXPLAIN_OPTIONS = frozenset(
    {"ANALYZE", "ANALYSE", "VERBOSE", "EXTENDED", "PARTITIONS", "QUERY", "PLAN"}
)
_ANALYZE = frozenset({"ANALYZE", "ANALYSE"})


def _carried(statement: Statement) -> tuple[Statement, Statement]:
    """An EXPLAIN's (or MariaDB ANALYZE's) options, and the statement it
    carries: what follows its first word, a parenthesised option list,
    option words and ``FORMAT=...``."""
    index, n = 1, len(statement)
    while index < n:
        token = statement[index]
        if token.kind == PUNCT and token.text == "(" and token.depth == 0:
            index += 1
            while index < n and statement[index].depth > 0:
                index += 1
            index += 1  # the closing parenthesis
        elif token.kind == WORD and token.text in _EXPLAIN_OPTIONS:
            index += 1
        elif token.kind == WORD and token.text == "FORMAT":
            index += 1
            if index < n and statement[index].kind == PUNCT and statement[index].text == "=":
                index += 1
            index += 1  # the format's name
        else:
            break
    return statement[:index], statement[index:]


def _analyzes(options: Statement) -> bool:
    """Whether the options may run the statement (``ANALYZE``, ``ANALYSE``,
    or any quoted name, which escapes can spell as anything:
    ``U&"\\0061nalyze"``): then the statement decides."""
    return any((t.kind == WORD and t.text in _ANALYZE) or t.kind == QUOTED for t in options)


def _after_for(statement: Statement) -> Statement | None:
    """The statement MariaDB's ``SET STATEMENT var = value, ... FOR`` runs."""
    for index, token in enumerate(statement):
        if token.kind == WORD and token.text == "FOR" and token.depth == 0:
            return statement[index + 1 :]
    return None


# MySQL's compound statements, which MariaDB runs outside stored programs
# (BEGIN NOT ATOMIC ... END, IF, CASE, LOOP, REPEAT, WHILE, FOR, a label), and
# the words that continue one after a ";": they hold statements the guard
# cannot judge one by one.
_MYSQL_COMPOUND = frozenset(
    {
        *("IF", "CASE", "LOOP", "REPEAT", "WHILE", "FOR", "UNTIL", "ELSE", "ELSEIF"),
        *("WHEN", "ITERATE", "LEAVE", "DECLARE", "RETURN"),
    }
)


def _compound(statement: Statement) -> bool:
    """A MySQL compound statement (or a part of one), or a labelled one."""
    first = statement[0]
    if first.kind != WORD:
        return False
    if first.text in _MYSQL_COMPOUND:
        return True
    second = statement[1] if len(statement) > 1 else None
    if first.text == "BEGIN" and second is not None and second.text == "NOT":
        return True
    return second is not None and second.kind == PUNCT and second.text == ":"


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


# The session settings that change the character set the server reads the
# text in (MySQL's SET NAMES, CHARSET and CHARACTER SET aside): the guard reads
# it as Django sends it, and in GBK or SJIS a backslash may end up inside a
# character, so what follows would be read differently.
_ENCODING_SETTINGS = frozenset(
    {"CLIENT_ENCODING", "CHARACTER_SET_CLIENT", "CHARACTER_SET_CONNECTION"}
)
ENCODING_CHANGE = "a change of the connection's character set"


def _changes_encoding(statement: Statement) -> bool:
    words = _words(statement)
    if words[:2] in (["SET", "NAMES"], ["SET", "CHARSET"]) or words[:3] == [
        "SET",
        "CHARACTER",
        "SET",
    ]:
        return True
    if words[:1] == ["SET"] and any(word in _ENCODING_SETTINGS for word in words):
        return True  # not SHOW client_encoding, nor SELECT @@character_set_client
    return "SET_CONFIG" in words and any(
        t.kind == QUOTED and t.text.upper() in _ENCODING_SETTINGS for t in statement
    )


def _ending(statement: Statement, reading: Reading) -> str | None:
    """The words that end (or may end) the transaction, or None."""
    words = _words(statement)
    if not words:
        return None
    if _changes_encoding(statement):
        return ENCODING_CHANGE
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
    if _compound(statement):
        return "a compound statement"
    if first in ("CREATE", "DROP") and "TEMPORARY" in words[1:4]:
        after = words.index("TEMPORARY") + 1
        if words[after : after + 1] == ["TABLE"]:
            return None  # a TEMPORARY SEQUENCE still commits
    if first in _MYSQL_IMPLICIT_COMMIT:
        return first
    if first in ("ANALYZE", "CHECK"):
        _, carried = _carried(statement)
        if second in _TABLE_FORMS or not carried:
            return f"{first} {second}".strip()  # ANALYZE TABLE, CHECK TABLE, CHECK VIEW
        return _ending(carried, reading)  # MariaDB's ANALYZE SELECT runs the SELECT
    if first == "LOAD" and second == "INDEX":
        return "LOAD INDEX"
    if first == "SET":
        if second == "PASSWORD":
            return "SET PASSWORD"
        if second == "STATEMENT":
            runs = _after_for(statement)
            return None if not runs else _ending(runs, reading)
        if second == "DEFAULT" and words[2:3] == ["ROLE"]:
            return "SET DEFAULT ROLE"
        if "AUTOCOMMIT" in words or _assigns_quoted(statement, "AUTOCOMMIT"):
            return "SET autocommit"  # @@autocommit, SESSION `autocommit`, not @autocommit
        return None
    if first == "EXECUTE" and second == "IMMEDIATE":
        return _ending_in_literal(statement, reading, "EXECUTE IMMEDIATE")
    if first == "PREPARE":
        return _ending_in_literal(statement, reading, "PREPARE")
    return None


def _assigns_quoted(statement: Statement, name: str) -> bool:
    """Whether a quoted name (MySQL's `autocommit`) is assigned: followed by
    ``=`` or ``:=``, as a string value never is."""
    return any(
        token.kind == QUOTED
        and token.text.upper() == name
        and following.kind == PUNCT
        and following.text in ("=", ":")
        for token, following in itertools.pairwise(statement)
    )


def _ending_in_literal(statement: Statement, reading: Reading, what: str) -> str | None:
    """MySQL's EXECUTE IMMEDIATE '...' and PREPARE s FROM '...' run the SQL
    in a literal: judge it when it is a plain one, written as it runs. From
    a variable, a hex or prefixed literal, or one with backslash escapes
    (``'C\\OMMIT'`` runs COMMIT), it cannot be read here."""
    quoted = [i for i, t in enumerate(statement) if t.kind == QUOTED and t.depth == 0]
    plain = (
        len(quoted) == 1
        and statement[quoted[0] - 1].text in ("IMMEDIATE", "FROM")
        and "\\" not in statement[quoted[0]].text
        and not any(t.kind == VARIABLE for t in statement)
    )
    if not plain:
        return f"{what} of SQL the guard cannot read"
    literal = statement[quoted[0]].text
    for each in _readings(literal, reading.vendor, None):
        for inner in split(literal, each):
            ending = _ending(inner, each)
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
_WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "MERGE", "REPLACE", "UPSERT", "COPY", "CALL"})


def _is_read(statement: Statement, reading: Reading) -> bool:
    words = [t for t in statement if t.kind == WORD]
    if not words:
        return True
    first = words[0].text
    second = words[1].text if len(words) > 1 else ""
    vendor = reading.vendor
    if vendor == "mysql" and _compound(statement):
        return False
    if _changes_encoding(statement):
        return False
    if first == "SET" and second == "STATEMENT":
        carried = _after_for(statement)
        return carried is not None and _is_read(carried, reading)
    if first in _NO_DATA:
        return not (first == "SET" and second == "PASSWORD")
    if first in ("EXPLAIN", "DESCRIBE", "DESC") or (first == "ANALYZE" and vendor == "mysql"):
        return _explained_is_read(statement, reading)
    if first == "COPY":
        return _copies_out(statement, reading)
    if first == "PRAGMA":
        return _pragma_asks(statement)
    if first == "DO":
        # MySQL's DO evaluates expressions, as a SELECT does (a function that
        # writes is not covered either way); PostgreSQL's runs a code block.
        return vendor == "mysql" and not _writes_inside(statement, reading)
    if first not in _READ_STARTS and not (statement[0].kind == PUNCT and statement[0].text == "("):
        return False
    return not _writes_inside(statement, reading)


def _explained_is_read(statement: Statement, reading: Reading) -> bool:
    """EXPLAIN and DESCRIBE only plan a statement, unless they ANALYZE it
    (PostgreSQL's EXPLAIN ANALYZE and MySQL's run it), as MariaDB's ANALYZE
    <statement> does: then the statement decides. MariaDB's ANALYZE TABLE
    writes statistics."""
    first = statement[0].text
    options, carried = _carried(statement)
    if first == "ANALYZE":
        return bool(carried) and carried[0].text not in _TABLE_FORMS and _is_read(carried, reading)
    if not carried or not _analyzes(options):
        return True  # a plan, DESCRIBE table, EXPLAIN FOR CONNECTION ...
    return _is_read(carried, reading)


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


# -- the two questions ------------------------------------------------------------

_FIRST_WORD = re.compile(r"\s*([A-Za-z]+)\b")
# One statement whose first word alone says it ends no transaction.
_FAST_KEEPS_TRANSACTION = frozenset(
    {"SELECT", "INSERT", "UPDATE", "DELETE", "SAVEPOINT", "RELEASE"}
)
# One statement whose first word alone says it is a read (SELECT ... INTO
# aside, which the lexer reads).
_FAST_READ = frozenset({"SELECT", "SAVEPOINT", "RELEASE"})
# A text that may change how its own later statements are quoted.
_QUOTING_SETTINGS = re.compile("sql_mode|standard_conforming_strings", re.IGNORECASE)


def _fast_word(sql: str, vendor: str) -> str | None:
    # PostgreSQL's set_config() can change client_encoding from a SELECT (a
    # lowered copy is ten times cheaper than a case-blind search).
    if ";" in sql or (vendor == "postgresql" and "set_config" in sql.lower()):
        return None
    match = _FIRST_WORD.match(sql)
    return match.group(1).upper() if match else None


# The session's quoting as the driver reports it (asked only when a text
# needs the lexer), or None when it cannot say.
SessionQuoting = Callable[[], Quoting | None] | None


def _readings(sql: str, vendor: str, session: SessionQuoting) -> Iterator[Reading]:
    """Every way the server may read this text: in the session's quoting
    when the driver reports it and the text cannot change it (every quoting
    otherwise, but for a text without a backslash, which every quoting reads
    alike), with MySQL's conditional comments run and not run when it holds
    one."""
    quoting = None if session is None or _QUOTING_SETTINGS.search(sql) else session()
    if quoting is not None:
        quotings: tuple[Quoting, ...] = (quoting,)
    else:
        quotings = QUOTINGS[vendor] if "\\" in sql else QUOTINGS[vendor][:1]
    conditional = vendor == "mysql" and "/*" in sql
    for each, runs in itertools.product(quotings, (True, False) if conditional else (True,)):
        yield Reading(vendor, each, conditional_comments_run=runs)


def ends_transaction(sql: str, vendor: str, quoting: SessionQuoting = None) -> str | None:
    """What in ``sql`` starts or ends the transaction it runs in (on MySQL,
    commits it implicitly, or may), or None when nothing does, however the
    server reads it."""
    if _fast_word(sql, vendor) in _FAST_KEEPS_TRANSACTION:
        return None
    for reading in _readings(sql, vendor, quoting):
        for statement in split(sql, reading):
            ending = _ending(statement, reading)
            if ending is not None:
                return ending
    return None


def is_read(sql: str, vendor: str, quoting: SessionQuoting = None) -> bool:
    """Whether every statement in ``sql`` only reads, however the server
    reads it.

    The rule: a statement is a read when it starts with SELECT, VALUES,
    TABLE, SHOW, DESCRIBE, EXPLAIN (unless it analyzes a statement that is
    not a read), WITH or a parenthesis, and nothing in it starts a statement
    that changes data (INSERT, UPDATE, DELETE, MERGE, REPLACE, COPY, CALL)
    nor selects INTO a table or file; or when it changes no data
    (transaction control, savepoints, SET, a PRAGMA that only asks, MySQL's
    DO). A statement that carries another (SET STATEMENT ... FOR, EXPLAIN
    ANALYZE, MariaDB's ANALYZE) is what it carries. Any other statement is
    not a read, whatever it is: PostgreSQL's DO blocks and MySQL's compound
    statements included.
    """
    if _fast_word(sql, vendor) in _FAST_READ and "into" not in sql.lower():
        return True
    return all(
        _is_read(statement, reading)
        for reading in _readings(sql, vendor, quoting)
        for statement in split(sql, reading)
    )


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
