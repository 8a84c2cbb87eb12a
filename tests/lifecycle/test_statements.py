"""The statement guard's two rules, one table per vendor: what ends the
work's transaction on the records' database, and what counts as a read on
any other. Pure text: no database needed (tests/lifecycle/test_work.py runs them
against real servers)."""

from __future__ import annotations

import pytest

from idempotency_app.lifecycle.statements import ENCODING_CHANGE, Quoting, ends_transaction, is_read

# (vendor, SQL, what ends the transaction or None)
ENDS = [
    # Every statement of a multi-statement text is judged.
    ("postgresql", "INSERT INTO t VALUES (1); COMMIT", "COMMIT"),
    ("mysql", "INSERT INTO t VALUES (1); COMMIT", "COMMIT"),
    ("sqlite", "INSERT INTO t VALUES (1); COMMIT", "COMMIT"),
    ("mysql", "INSERT INTO t VALUES (1);COMMIT;", "COMMIT"),
    ("postgresql", "SELECT 1; END", "END"),
    ("postgresql", "ABORT", "ABORT"),
    ("postgresql", "PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION"),
    ("postgresql", "START TRANSACTION", "START"),
    ("mysql", "BEGIN NOT ATOMIC INSERT INTO t VALUES (1); COMMIT; END", "BEGIN"),
    ("sqlite", "BEGIN IMMEDIATE", "BEGIN"),
    ("postgresql", "ROLLBACK", "ROLLBACK"),
    ("postgresql", "ROLLBACK AND CHAIN", "ROLLBACK"),
    # Savepoints are not transaction ends, however ROLLBACK TO is spelled.
    ("postgresql", "ROLLBACK TO SAVEPOINT s", None),
    ("mysql", "ROLLBACK WORK TO SAVEPOINT s", None),
    ("mysql", "ROLLBACK TRANSACTION TO SAVEPOINT s", None),
    ("postgresql", "ROLLBACK TRANSACTION TO s", None),
    ("sqlite", "ROLLBACK TO s", None),
    ("mysql", "SAVEPOINT s; RELEASE SAVEPOINT s", None),
    # Comments, as each vendor ends them.
    ("postgresql", "-- settle now\nCOMMIT", "COMMIT"),
    ("postgresql", "/* nested /* on PostgreSQL */ still a comment */ SELECT 1", None),
    ("postgresql", "/* nested /* on PostgreSQL */ COMMIT */ SELECT 1", None),
    ("mysql", "/* not nested /* on MySQL */ COMMIT */ SELECT 1", "COMMIT"),
    ("mysql", "# settle now\nCOMMIT", "COMMIT"),
    ("postgresql", "SELECT 1 # 2; COMMIT", "COMMIT"),
    ("mysql", "SELECT 1 -- ; COMMIT", None),
    ("mysql", "SELECT 1--1; COMMIT", "COMMIT"),  # "--" before a digit is arithmetic
    ("postgresql", "SELECT 1--1; COMMIT", None),
    # MySQL's executable comments run the SQL they hold.
    ("mysql", "/*!COMMIT*/", "COMMIT"),
    ("mysql", "/*!50000 COMMIT */", "COMMIT"),
    ("mysql", "/*M!100500 COMMIT */", "COMMIT"),
    ("mysql", "SELECT 1 /*!; COMMIT */", "COMMIT"),
    ("mysql", "SELECT 1 /*+ COMMIT */", None),  # an optimizer hint is a comment
    # Literals and quoted identifiers hold no statements.
    ("postgresql", "SELECT 'x; COMMIT'", None),
    ("postgresql", "SELECT $$;COMMIT$$", None),
    ("postgresql", "SELECT $tag$ $$; COMMIT $tag$", None),
    ("postgresql", 'SELECT 1 AS "; COMMIT"', None),
    ("mysql", "SELECT `; COMMIT`", None),
    ("sqlite", "SELECT [; COMMIT]", None),
    ("postgresql", "SELECT E'\\'; COMMIT; --'", None),
    # Judged by the strictest reading of the server's quoting settings:
    # with NO_BACKSLASH_ESCAPES (or standard_conforming_strings off), the
    # literal ends earlier and the COMMIT runs.
    ("mysql", "SELECT 'a\\'; COMMIT; --'", "COMMIT"),
    ("postgresql", "SELECT 'a\\'; COMMIT; --'", "COMMIT"),
    ("mysql", 'SELECT "a\\"; COMMIT; --"', "COMMIT"),
    ("sqlite", "SELECT 'a\\'; COMMIT; --'", "COMMIT"),  # SQLite has no escapes at all
    # MySQL: what commits implicitly, and what does not.
    ("mysql", "CREATE TABLE IF NOT EXISTS ledger (id int)", "CREATE"),
    ("mysql", "CREATE TEMPORARY TABLE scratch (id int)", None),
    ("mysql", "CREATE OR REPLACE TEMPORARY TABLE scratch (id int)", None),
    ("mysql", "DROP TEMPORARY TABLE scratch", None),
    ("mysql", "DROP TABLE scratch", "DROP"),
    ("mysql", "TRUNCATE TABLE t", "TRUNCATE"),
    ("mysql", "LOCK TABLES t WRITE", "LOCK"),
    ("mysql", "CHECK TABLE t", "CHECK TABLE"),
    ("mysql", "ANALYZE TABLE t", "ANALYZE TABLE"),
    ("mysql", "ANALYZE SELECT * FROM t", None),  # MariaDB runs the SELECT
    ("mysql", "ANALYZE FORMAT=JSON SELECT * FROM t", None),
    ("mysql", "CHECKSUM TABLE t", None),
    ("mysql", "LOAD INDEX INTO CACHE t", "LOAD INDEX"),
    ("mysql", "LOAD DATA LOCAL INFILE 'x' INTO TABLE t", None),
    ("mysql", "CALL record_audit('charged')", "CALL"),
    ("mysql", "SET autocommit = 1", "SET autocommit"),
    ("mysql", "SET @@session.autocommit = 1", "SET autocommit"),
    ("mysql", "SET sql_mode = '', autocommit = 1", "SET autocommit"),
    ("mysql", "SET @x = 'autocommit'", None),
    ("mysql", "SET @autocommit = 1", None),
    ("mysql", "SET PASSWORD = PASSWORD('x')", "SET PASSWORD"),
    ("mysql", "SET STATEMENT max_statement_time=1 FOR SELECT 1", None),
    ("mysql", "EXECUTE IMMEDIATE 'COMMIT'", "COMMIT"),
    ("mysql", "EXECUTE IMMEDIATE 'SELECT 1'", None),
    ("mysql", "EXECUTE IMMEDIATE @statement", "EXECUTE IMMEDIATE of SQL the guard cannot read"),
    ("mysql", "PREPARE s FROM 'COMMIT'", "COMMIT"),
    ("mysql", "PREPARE s FROM 'INSERT INTO t VALUES (?)'", None),
    ("mysql", "XA START 'x'", "XA"),
    # Statements that carry another are what they carry.
    ("mysql", "SET STATEMENT max_statement_time=60 FOR COMMIT AND CHAIN", "COMMIT"),
    ("mysql", "SET STATEMENT max_statement_time=60 FOR START TRANSACTION", "START"),
    ("mysql", "SET STATEMENT max_statement_time=60 FOR DROP TABLE x", "DROP"),
    ("mysql", "EXECUTE IMMEDIATE 'SET STATEMENT max_statement_time=1 FOR COMMIT'", "COMMIT"),
    # MariaDB runs compound statements outside stored programs.
    (
        "mysql",
        "REPEAT COMMIT; INSERT INTO t VALUES (1); UNTIL 1 END REPEAT",
        "a compound statement",
    ),
    ("mysql", "IF 1 THEN COMMIT; END IF", "a compound statement"),
    ("mysql", "scope: BEGIN NOT ATOMIC SELECT 1; END", "a compound statement"),
    ("mysql", "WHILE 0 DO SELECT 1; END WHILE", "a compound statement"),
    # A conditional comment may run or not, by the server: both are judged.
    ("mysql", "/*!80000 SELECT 1, */ COMMIT AND CHAIN", "COMMIT"),
    ("mysql", "/*M!999999 SELECT 1, */ COMMIT AND CHAIN", "COMMIT"),
    ("mysql", "DROP /*!99999 TEMPORARY */ TABLE x", "DROP"),
    ("mysql", "CREATE /*!99999 TEMPORARY */ TABLE x (id int)", "CREATE"),
    ("mysql", "SELECT 1 /*!50000 + 1 */", None),
    # PostgreSQL and SQLite keep DDL inside the transaction.
    ("postgresql", "CREATE TABLE IF NOT EXISTS ledger (id integer)", None),
    ("sqlite", "CREATE TABLE IF NOT EXISTS ledger (id integer)", None),
    ("postgresql", "CALL record_audit('charged')", None),  # a procedure cannot COMMIT here
    ("postgresql", "SET LOCAL lock_timeout = '1s'", None),
    ("postgresql", "ANALYZE t", None),
    # What Django's ORM sends.
    ("postgresql", 'SELECT "t"."id" FROM "t" WHERE "t"."id" = %s', None),
    ("mysql", "INSERT INTO `t` (`a`) VALUES (%s)", None),
    ("sqlite", 'UPDATE "t" SET "a" = %s', None),
    ("postgresql", 'SAVEPOINT "s1_x"', None),
    # SQL in a literal is judged only when written as it runs.
    (
        "mysql",
        "EXECUTE IMMEDIATE x'434f4d4d4954'",
        "EXECUTE IMMEDIATE of SQL the guard cannot read",
    ),
    ("mysql", "PREPARE s FROM X'434f4d4d4954'", "PREPARE of SQL the guard cannot read"),
    ("mysql", "EXECUTE IMMEDIATE 'C\\OMMIT'", "EXECUTE IMMEDIATE of SQL the guard cannot read"),
    ("mysql", "PREPARE s FROM _latin1'COMMIT'", "PREPARE of SQL the guard cannot read"),
    ("mysql", "PREPARE s FROM 'SELECT ?'", None),
    # Implicit commits MariaDB makes that a first word does not show.
    ("mysql", "SELECT 1; SET DEFAULT ROLE NONE; SELECT 2", "SET DEFAULT ROLE"),
    ("mysql", "CREATE TEMPORARY SEQUENCE s1", "CREATE"),
    ("mysql", "CREATE OR REPLACE TEMPORARY TABLE t (a INT)", None),
    ("mysql", "SET `autocommit` = 1", "SET autocommit"),
    ("mysql", "SET SESSION `autocommit`:=0", "SET autocommit"),
    ("mysql", "SET @x = 'autocommit'", None),
    # The character set the server reads the text in is not changed.
    ("mysql", "SET NAMES gbk", ENCODING_CHANGE),
    ("mysql", "SET CHARACTER SET gbk", ENCODING_CHANGE),
    ("mysql", "SET @@character_set_client = 'gbk'", ENCODING_CHANGE),
    ("postgresql", "SET client_encoding = 'EUC_JP'", ENCODING_CHANGE),
    ("postgresql", "SELECT set_config('client_encoding', 'SJIS', false)", ENCODING_CHANGE),
    ("postgresql", "SELECT set_config('app.tenant', '1', false)", None),
    ("postgresql", "SHOW client_encoding", None),
    ("mysql", "SELECT @@character_set_client; SELECT 1", None),
]


@pytest.mark.parametrize(("vendor", "sql", "ending"), ENDS)
def test_what_ends_the_transaction(vendor: str, sql: str, ending: str | None) -> None:
    assert ends_transaction(sql, vendor) == ending


# (vendor, SQL, whether it is a read)
READS = [
    ("postgresql", "SELECT * FROM t", True),
    ("postgresql", "SELECT 1; INSERT INTO t VALUES (1)", False),
    ("mysql", "SELECT 1; INSERT INTO t VALUES (1)", False),
    ("sqlite", "SELECT 1; DELETE FROM t", False),
    ("postgresql", "SELECT 1; SELECT 2", True),
    ("postgresql", "VALUES (1)", True),
    # A quoted EXPLAIN option may spell ANALYZE with escapes.
    ("postgresql", 'EXPLAIN (U&"\\0061nalyze") INSERT INTO t VALUES (1)', False),
    ("postgresql", 'EXPLAIN (U&"\\0061nalyze") SELECT 1', True),
    ("postgresql", "EXPLAIN (FORMAT JSON) INSERT INTO t VALUES (1)", True),
    ("postgresql", "SET client_encoding = 'SJIS'", False),
    ("mysql", "SET NAMES gbk", False),
    ("postgresql", "TABLE t", True),
    ("mysql", "SHOW TABLES", True),
    ("mysql", "DESCRIBE t", True),
    ("postgresql", "(SELECT 1) UNION (SELECT 2)", True),
    ("postgresql", "SELECT * FROM t FOR UPDATE", True),  # a lock, not a write
    ("mysql", "SELECT * FROM t LOCK IN SHARE MODE", True),
    # WITH: a read when its main statement and every CTE are.
    ("postgresql", "WITH x AS (SELECT 'update' AS a, 'insert' AS b) SELECT * FROM x", True),
    ("mysql", "WITH x AS (SELECT 'delete; insert' AS a) SELECT * FROM x", True),
    ("postgresql", "WITH e AS (DELETE FROM t RETURNING *) SELECT * FROM e", False),
    ("postgresql", "WITH e AS NOT MATERIALIZED (UPDATE t SET a = 1 RETURNING *) SELECT 1", False),
    ("postgresql", "WITH e AS (SELECT 1 AS n) INSERT INTO t SELECT n FROM e", False),
    ("sqlite", "WITH e AS (SELECT 1 AS n) INSERT INTO t SELECT n FROM e", False),
    (
        "postgresql",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT n FROM r",
        True,
    ),
    # EXPLAIN plans; EXPLAIN ANALYZE runs what it explains.
    ("postgresql", "EXPLAIN SELECT 1", True),
    ("postgresql", "EXPLAIN INSERT INTO t VALUES (1)", True),
    ("postgresql", "EXPLAIN ANALYZE INSERT INTO t VALUES (1)", False),
    ("postgresql", "EXPLAIN (ANALYZE, BUFFERS) DELETE FROM t", False),
    ("postgresql", "EXPLAIN (ANALYZE true, FORMAT JSON) SELECT 1", True),
    ("mysql", "EXPLAIN ANALYZE SELECT 1", True),
    ("mysql", "ANALYZE SELECT * FROM t", True),  # MariaDB's explain(analyze=True)
    ("mysql", "ANALYZE FORMAT=JSON SELECT * FROM t", True),
    ("mysql", "ANALYZE UPDATE t SET a = 1", False),
    ("mysql", "ANALYZE TABLE t", False),
    # ANALYZE however it is spelt, and what it runs, however it starts.
    ("postgresql", "EXPLAIN ANALYSE INSERT INTO t VALUES (1)", False),
    ("postgresql", "EXPLAIN (ANALYSE) INSERT INTO t VALUES (1)", False),
    ("postgresql", 'EXPLAIN ("analyze") INSERT INTO t VALUES (1)', False),
    ("postgresql", "EXPLAIN (ANALYSE 'on') INSERT INTO t VALUES (1)", False),
    ("postgresql", "EXPLAIN ANALYZE CREATE TABLE c AS SELECT * FROM t", False),
    ("postgresql", "EXPLAIN ANALYZE CREATE MATERIALIZED VIEW v AS SELECT 1", False),
    (
        "postgresql",
        "EXPLAIN (ANALYZE) WITH x AS (INSERT INTO t VALUES (1) RETURNING id) SELECT * FROM x",
        False,
    ),
    ("postgresql", "EXPLAIN (FORMAT JSON, VERBOSE) SELECT 1", True),
    ("mysql", "EXPLAIN FORMAT=JSON SELECT 1", True),
    ("mysql", "EXPLAIN FOR CONNECTION 42", True),
    # MariaDB: what SET STATEMENT carries, compound statements, conditional comments.
    ("mysql", "SET STATEMENT max_statement_time=60 FOR INSERT INTO t VALUES (1)", False),
    ("mysql", "SET STATEMENT max_statement_time=60 FOR SELECT 1", True),
    ("mysql", "BEGIN NOT ATOMIC INSERT INTO t VALUES (1); END", False),
    ("mysql", "/*!99999 SELECT */ INSERT INTO t VALUES (1)", False),
    ("mysql", "SELECT 1 /*!99999 ' */; INSERT INTO t VALUES (1); SELECT '/*!99999 ' */", False),
    ("sqlite", "EXPLAIN QUERY PLAN SELECT 1", True),
    # SELECT ... INTO: a table on PostgreSQL, a file on MySQL; a variable is a read.
    ("postgresql", "SELECT * INTO new_table FROM t", False),
    ("mysql", "SELECT a INTO @x FROM t", True),
    ("mysql", "SELECT a INTO OUTFILE '/tmp/x' FROM t", False),
    ("mysql", "SELECT a FROM t INTO DUMPFILE '/tmp/x'", False),
    # COPY: out to the client only.
    ("postgresql", "COPY t TO STDOUT", True),
    ("postgresql", "COPY (SELECT * FROM t) TO STDOUT WITH (FORMAT csv)", True),
    ("postgresql", "COPY t FROM STDIN", False),
    ("postgresql", "COPY (INSERT INTO t VALUES (1) RETURNING 1) TO STDOUT", False),
    ("postgresql", "COPY t TO '/tmp/t.csv'", False),
    ("postgresql", "COPY t TO PROGRAM 'gzip > /tmp/t.gz'", False),
    # Writes, however they start.
    ("postgresql", "INSERT INTO t VALUES (1)", False),
    ("mysql", "REPLACE INTO t VALUES (1)", False),
    ("postgresql", "MERGE INTO t USING s ON true WHEN MATCHED THEN DELETE", False),
    ("mysql", "/*!INSERT INTO t (note) */ SELECT 'audit'", False),
    ("postgresql", "/* a comment */ UPDATE t SET a = 1", False),
    ("postgresql", "CALL post_ledger_entry('x')", False),
    ("postgresql", "DO $$ BEGIN INSERT INTO t VALUES (1); END $$", False),
    ("mysql", "DO RELEASE_LOCK('x')", True),  # expressions, as a SELECT evaluates them
    ("mysql", "DO SLEEP(0)", True),
    ("postgresql", "CREATE TABLE x (id integer)", False),
    ("mysql", "LOCK TABLES t READ", False),
    # No data changes: transaction control and session settings.
    ("postgresql", "BEGIN", True),
    ("postgresql", "COMMIT", True),
    ("mysql", 'SAVEPOINT "s"', True),
    ("mysql", "SET @x = 1", True),
    ("postgresql", "SET LOCAL statement_timeout = 1000", True),
    ("mysql", "SET PASSWORD = PASSWORD('x')", False),
    # SQLite's PRAGMAs: those that only ask.
    ("sqlite", "PRAGMA table_info(t)", True),
    ("sqlite", "PRAGMA user_version", True),
    ("sqlite", "PRAGMA user_version = 3", False),
    ("sqlite", "PRAGMA journal_mode(WAL)", False),
    ("sqlite", "PRAGMA optimize", False),
    # Unknown statements are not reads.
    ("postgresql", "LISTEN channel", False),
    ("mysql", "HANDLER t OPEN", False),
    ("postgresql", "SELECT 'unterminated", True),  # the server refuses it: nothing runs
    # Empty text, or comments only, runs nothing.
    ("postgresql", "", True),
    ("mysql", "-- nothing\n", True),
]


@pytest.mark.parametrize(("vendor", "sql", "read"), READS)
def test_what_counts_as_a_read(vendor: str, sql: str, read: bool) -> None:
    assert is_read(sql, vendor) is read


def test_the_sessions_quoting_decides_when_the_driver_reports_it() -> None:
    """Read in every quoting, "'it\\'s', 'a;b'" could be two statements; in
    the quoting the session reports it is one literal, and a read."""
    text = "SELECT 'it\\'s', 'a;b'"
    assert not is_read(text, "mysql"), "unknown quoting: the strictest reading"
    assert is_read(text, "mysql", lambda: Quoting(backslash=True))
    assert not is_read(text, "mysql", lambda: Quoting(backslash=False))
    changing = "SET sql_mode = 'NO_BACKSLASH_ESCAPES'; " + text
    assert not is_read(changing, "mysql", lambda: Quoting(backslash=True)), (
        "a text that changes the SQL mode is read every way"
    )
