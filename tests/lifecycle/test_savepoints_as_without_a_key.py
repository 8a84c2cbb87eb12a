"""Work whose savepoints the library sends in fewer round trips (on
PostgreSQL the first SAVEPOINT with the BEGIN, each RELEASE with the next
statement) must behave as it does without a key: every test compares the
work run under a key with the same work in a plain ``transaction.atomic()``,
with execute wrappers of its own, Django's query log, session settings and
the connection's state afterwards."""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from idempotency_app import service
from idempotency_app.models import IdempotencyRecord
from tests.conftest import charge_labels as labels
from tests.savepoints import savepoint
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

SCOPE = "tests:as-without-a-key"


def once(key: str, work: Callable[[], Any]) -> Any:
    with service.once(SCOPE, key, "tests.as_without_a_key") as run:
        if run.should_execute:
            run.result = work()
    return run.result


def outcome(work: Callable[[], Any], keyed: bool) -> tuple[Any, list[str]]:
    """(result or exception class name, labels committed); the table emptied after."""
    try:
        if keyed:
            result: Any = once(str(uuid.uuid4()), work)
        else:
            with transaction.atomic():
                result = work()
    except Exception as exc:
        result = f"raised {type(exc).__name__}: {exc}"
    committed = labels()
    Charge.objects.all().delete()
    return result, committed


def same_with_and_without(work: Callable[[], Any]) -> tuple[Any, Any]:
    plain = outcome(work, keyed=False)
    keyed = outcome(work, keyed=True)
    return plain, keyed


def _txstatus() -> Any:
    return connection.connection.info.transaction_status


# 1. A user execute_wrapper installed inside the work that refuses SAVEPOINT.
def test_inner_execute_wrapper_refusing_savepoints_still_refuses() -> None:
    def no_savepoints(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        if str(sql).startswith("SAVEPOINT"):
            raise RuntimeError("no savepoints here")
        return execute(sql, params, many, context)

    def work() -> str:
        with connection.execute_wrapper(no_savepoints), transaction.atomic():
            Charge.objects.create(label="inside")
        return "done"

    plain, keyed = same_with_and_without(work)
    assert plain[0].startswith("raised"), plain
    assert keyed == plain, (plain, keyed)


# 2. A user execute_wrapper inside the work sees the same statements.
def test_inner_execute_wrapper_sees_the_savepoint() -> None:
    seen: list[str] = []

    def record(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        seen.append(str(sql).split(" ")[0])
        return execute(sql, params, many, context)

    def work() -> str:
        with connection.execute_wrapper(record), transaction.atomic():
            Charge.objects.create(label="inside")
        return "done"

    seen.clear()
    outcome(work, keyed=False)
    plain_seen = list(seen)
    seen.clear()
    outcome(work, keyed=True)
    assert "SAVEPOINT" in plain_seen
    assert "SAVEPOINT" in seen, (plain_seen, seen)


# 2b. An execute wrapper the project installed around the work, and an agent
# that replaced CursorWrapper.execute, see the savepoints too: the library
# sends them without a cursor only where nobody would have seen them.
def _kinds_seen_by(install: Callable[[list[str]], Any]) -> tuple[list[str], list[str]]:
    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="inside")
        return "done"

    seen: list[str] = []
    with install(seen):
        outcome(work, keyed=False)
        plain_seen, seen[:] = list(seen), []
        outcome(work, keyed=True)
    return plain_seen, seen


def test_an_outer_execute_wrapper_sees_the_savepoint_and_its_release() -> None:
    def record(seen: list[str]) -> Any:
        def wrapper(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
            seen.append(str(sql).split(" ")[0])
            return execute(sql, params, many, context)

        return connection.execute_wrapper(wrapper)

    plain_seen, keyed_seen = _kinds_seen_by(record)
    assert {"SAVEPOINT", "RELEASE"} <= set(plain_seen), plain_seen
    assert {"SAVEPOINT", "RELEASE"} <= set(keyed_seen), keyed_seen


def test_a_replaced_cursor_wrapper_execute_sees_the_savepoint_and_its_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.db.backends.utils import CursorWrapper

    django_execute = CursorWrapper.execute

    @contextlib.contextmanager
    def record(seen: list[str]) -> Iterator[None]:
        def execute(self: Any, sql: Any, params: Any = None) -> Any:  # as an APM agent's
            seen.append(str(sql).split(" ")[0])
            return django_execute(self, sql, params)

        with monkeypatch.context() as patched:
            patched.setattr(CursorWrapper, "execute", execute)
            yield

    plain_seen, keyed_seen = _kinds_seen_by(record)
    assert {"SAVEPOINT", "RELEASE"} <= set(plain_seen), plain_seen
    assert {"SAVEPOINT", "RELEASE"} <= set(keyed_seen), keyed_seen


@pytest.mark.postgresql
def test_a_block_in_the_work_makes_no_cursor() -> None:
    """Where nobody would see the difference, a block's SAVEPOINT and RELEASE
    make no cursor (each would cost more than the rest of the block): this
    fails if Django stops creating savepoints through the connection's
    ``_savepoint`` and ``_savepoint_commit``."""
    made: list[str] = []
    connection.ensure_connection()
    # Counted by a profile hook: a create_cursor replaced on the connection
    # would be an agent's, and the blocks would then make their cursors.
    create_cursor = type(connections["default"]).create_cursor
    code = getattr(create_cursor, "__wrapped__", create_cursor).__code__

    def counting(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            made.append("cursor")

    def work() -> list[str]:
        Charge.objects.create(label="before")
        sys.setprofile(counting)
        try:
            with transaction.atomic(), transaction.atomic():
                pass
            with transaction.atomic():
                pass
            Charge.objects.create(label="after")  # counted: the hook sees cursors made
        finally:
            sys.setprofile(None)
        return made

    assert once(str(uuid.uuid4()), work) == ["cursor"]
    assert "before" in labels()
    assert "_savepoint" not in vars(connection), "Django's own methods are back"


# 3. connection.queries (CaptureQueriesContext / DEBUG) shows the SAVEPOINT's SQL.
def test_captured_queries_show_the_savepoint_sql() -> None:
    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="inside")
        return "done"

    with CaptureQueriesContext(connection) as plain_q:
        outcome(work, keyed=False)
    with CaptureQueriesContext(connection) as keyed_q:
        once(str(uuid.uuid4()), work)
    plain_sql = [q["sql"] for q in plain_q.captured_queries]
    keyed_sql = [q["sql"] for q in keyed_q.captured_queries]
    assert any(isinstance(s, str) and s.startswith("SAVEPOINT") for s in plain_sql), plain_sql
    # Logged as sent, RELEASE included: never an entry whose SQL is None.
    assert all(isinstance(s, str) for s in keyed_sql), keyed_sql
    assert any(isinstance(s, str) and s.startswith("SAVEPOINT") for s in keyed_sql), [
        s and s[:40] for s in keyed_sql
    ]


# 4. Session default isolation (not a psycopg attribute) still applies.
@pytest.mark.postgresql
def test_session_default_isolation_is_kept() -> None:
    def work() -> str:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            return str(cursor.fetchone()[0])

    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE")
    try:
        plain, keyed = same_with_and_without(work)
    finally:
        connection.close()
    assert plain[0] == "serializable"
    assert keyed == plain


# 5. read_only set by hand on the psycopg connection inside the work.
@pytest.mark.postgresql
def test_read_only_set_by_hand_before_the_block() -> None:
    def work() -> str:
        connection.connection.read_only = True
        try:
            with transaction.atomic():
                Charge.objects.create(label="inside")
            return "done"
        finally:
            pass

    try:
        plain = outcome(work, keyed=False)
        connection.close()
        keyed = outcome(work, keyed=True)
    finally:
        connection.close()
    assert plain[0].startswith("raised"), plain
    assert keyed[0].startswith("raised") and keyed[1] == [], keyed


# 6. State after the work: the next statement works, in_atomic_block, txn status.
@pytest.mark.postgresql
def test_connection_state_after_begin_with() -> None:
    from psycopg import pq

    hooks: list[str] = []

    def work() -> str:
        with transaction.atomic():
            Charge.objects.create(label="inside")
            transaction.on_commit(lambda: hooks.append("inner"))
        transaction.on_commit(lambda: hooks.append("outer"))
        assert connection.in_atomic_block
        assert _txstatus() == pq.TransactionStatus.INTRANS
        return "done"

    assert once(str(uuid.uuid4()), work) == "done"
    assert hooks == ["inner", "outer"]
    assert not connection.in_atomic_block
    assert _txstatus() == pq.TransactionStatus.IDLE
    assert labels() == ["inside"]
    # again on the same connection
    assert once(str(uuid.uuid4()), work) == "done"
    assert labels() == ["inside", "inside"]


# 7. A session killed by idle_session_timeout between claim and the first block.
@pytest.mark.postgresql
def test_idle_session_timeout_before_first_block_is_an_outage() -> None:
    from django.db import OperationalError

    from idempotency_app.exceptions import StoreUnavailable

    key = str(uuid.uuid4())
    connection.close()
    with connection.cursor() as cursor:
        cursor.execute("SET idle_session_timeout = '300ms'")

    def work() -> str:
        time.sleep(1.0)
        with transaction.atomic():
            Charge.objects.create(label="never")
        return "done"

    try:
        with pytest.raises((OperationalError, StoreUnavailable)):
            once(key, work)
    finally:
        connection.close()
    assert labels() == []
    assert not IdempotencyRecord.objects.filter(key=key, response_body__isnull=False).exists()
    # the key can run again
    assert once(key, lambda: Charge.objects.create(label="again") and "ok") == "ok"


# 8. savepoint() called directly as the first statement.
def test_manual_savepoint_first() -> None:
    def work() -> str:
        sid = savepoint()
        Charge.objects.create(label="undone")
        transaction.savepoint_rollback(sid)
        Charge.objects.create(label="kept")
        sid2 = savepoint()
        Charge.objects.create(label="kept2")
        transaction.savepoint_commit(sid2)
        return "done"

    plain, keyed = same_with_and_without(work)
    assert plain == ("done", ["kept", "kept2"])
    assert keyed == plain


# 9. Nested atomic first, inner rolled back, outer kept; and savepoint=False first.
def test_nested_first_blocks() -> None:
    def work() -> str:
        with transaction.atomic():
            with transaction.atomic():
                try:
                    with transaction.atomic():
                        Charge.objects.create(label="undone")
                        raise ValueError
                except ValueError:
                    pass
                Charge.objects.create(label="a")
            with transaction.atomic(savepoint=False):
                Charge.objects.create(label="b")
        return "done"

    plain, keyed = same_with_and_without(work)
    assert plain == ("done", ["a", "b"])
    assert keyed == plain


# 10. A held release put back after an error without SQLSTATE from a statement that ran.
def test_wrapper_raising_after_a_statement_carrying_a_release() -> None:
    table = connection.ops.quote_name(Charge._meta.db_table)

    def after_the_fact(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if "INSERT" in str(sql) and "'b'" in str(sql):
            raise RuntimeError("query budget exceeded")
        return result

    def work() -> str:
        Charge.objects.create(label="first")
        try:
            with transaction.atomic():  # X
                with transaction.atomic():  # Y
                    Charge.objects.create(label="a")
                # RELEASE Y is held, goes with the next statement
                with connection.execute_wrapper(after_the_fact), connection.cursor() as c:
                    c.execute(f"INSERT INTO {table} (label, amount) VALUES ('b', 0)")
        except RuntimeError:
            pass
        Charge.objects.create(label="c")
        return "done"

    plain, keyed = same_with_and_without(work)
    assert plain == ("done", ["c", "first"]), plain
    assert keyed == plain, (plain, keyed)


# 11. The same, the wrapper raising after a SAVEPOINT-carrying statement in the work's
# first block (the released savepoint put back is then sent again at the completion).
def test_wrapper_raising_after_statement_then_block_rolled_back_by_hand() -> None:
    table = connection.ops.quote_name(Charge._meta.db_table)

    def after_the_fact(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if "'b'" in str(sql):
            raise RuntimeError("budget")
        return result

    def work() -> str:
        try:
            with transaction.atomic():  # X, opens the transaction
                with transaction.atomic():
                    Charge.objects.create(label="a")
                with connection.execute_wrapper(after_the_fact), connection.cursor() as c:
                    c.execute(f"INSERT INTO {table} (label, amount) VALUES ('b', 0)")
        except RuntimeError:
            pass
        return "done"

    plain, keyed = same_with_and_without(work)
    assert plain == ("done", []), plain
    assert keyed == plain, (plain, keyed)
