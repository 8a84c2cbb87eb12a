"""What each database driver reports about its connection, read from the
driver with no round trip: whether a transaction is open (asked before and
after every statement the work sends), how the session reads quotes, and
whether an error was a lock conflict.

- psycopg 3: ``pgconn.transaction_status``; psycopg2:
  ``get_transaction_status()`` (libpq's idle, active, in transaction, in
  error, unknown).
- sqlite3: ``Connection.in_transaction``.
- mysqlclient: the server's status flags arrive with every reply, but the
  driver does not expose them. Built against MariaDB Connector/C (as on
  Debian and in mysqlclient's own wheels), ``mariadb_get_info`` reads
  ``SERVER_STATUS_IN_TRANS`` from the native connection that
  ``_get_native_connection()`` hands out; against another client library
  the status is unknown (check W010 says so).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from django.db import InterfaceError, OperationalError

from idempotency_app.lifecycle.statements import Quoting

TransactionProbe = Callable[[], bool | None]

# libpq's PQTRANS_IDLE: no transaction open (the others are active, in a
# transaction, in a failed one, or a connection gone bad).
_PQ_IDLE = 0
# MariaDB Connector/C: enum mariadb_value's MARIADB_CONNECTION_SERVER_STATUS,
# and the server status flags: a transaction is open, the SQL mode has
# NO_BACKSLASH_ESCAPES, and (MariaDB) ANSI_QUOTES.
_MARIADB_CONNECTION_SERVER_STATUS = 30
_SERVER_STATUS_IN_TRANS = 1
_SERVER_STATUS_NO_BACKSLASH_ESCAPES = 512
_SERVER_STATUS_ANSI_QUOTES = 32768
# MySQL lock wait timeout and deadlock; PostgreSQL deadlock, lock timeout and
# serialization failure.
_MYSQL_LOCK_ERRORS = {1205, 1213}
_POSTGRES_LOCK_STATES = {"40P01", "55P03", "40001"}


def transaction_probe(connection: Any) -> TransactionProbe | None:
    """A function telling whether ``connection`` (a Django connection,
    connected) has a transaction open: True, False, or None when it cannot
    tell (the connection closed meanwhile). None when this driver never can."""
    raw = connection.connection
    if raw is None:
        return None
    vendor = connection.vendor
    if vendor == "sqlite":
        return lambda: bool(raw.in_transaction)
    if vendor == "postgresql":
        pgconn = getattr(raw, "pgconn", None)
        if pgconn is not None:  # psycopg 3
            return lambda: pgconn.transaction_status != _PQ_IDLE
        return lambda: bool(raw.get_transaction_status() != _PQ_IDLE)  # psycopg2
    if vendor == "mysql":
        return _mysql_probe(raw)
    return None


def session(raw: Any) -> Any:
    """Which server session the driver connection ``raw`` is, whatever
    proxy an APM agent put around it (the proxy hands these on): psycopg's
    libpq connection, or mysqlclient's server thread id; None once closed."""
    if raw is None:
        return None
    pgconn = getattr(raw, "pgconn", None)
    if pgconn is not None:
        return pgconn
    if hasattr(raw, "thread_id"):  # mysqlclient
        return raw.thread_id() if raw.open else None
    return raw


def _mysql_probe(raw: Any) -> TransactionProbe | None:
    status = _mysql_status(raw)
    if status is None:
        return None

    def probe() -> bool | None:
        flags = status()
        return None if flags is None else bool(flags & _SERVER_STATUS_IN_TRANS)

    return probe


def _mysql_status(raw: Any) -> Callable[[], int | None] | None:
    """A function reading the server status flags of mysqlclient's
    connection ``raw``, or None when the client library cannot say."""
    get_info = _mariadb_get_info()
    native = getattr(raw, "_get_native_connection", None)
    if get_info is None or native is None:
        return None
    capsule = native()
    pointer = _capsule_pointer(capsule, _capsule_name(capsule))
    status = ctypes.c_uint()
    reference = ctypes.byref(status)

    def flags() -> int | None:
        # The MYSQL struct lives inside the driver's connection object, which
        # this closure keeps alive; a closed connection's status is stale.
        if not raw.open:
            return None
        get_info(pointer, _MARIADB_CONNECTION_SERVER_STATUS, reference)
        return status.value

    return flags


def refresh_status(connection: Any) -> None:
    """Make mysqlclient's status current: an error reply carries none, so
    after one the driver still reports the status before it. A statement
    that touches no table answers with the status as it is now."""
    with contextlib.suppress(Exception):
        connection.connection.query("DO 0")


def quoting(connection: Any) -> Quoting | None:
    """How the session of ``connection`` (connected) reads quotes, as its
    driver reports it; None when it cannot say."""
    raw = connection.connection
    if raw is None:
        return None
    if connection.vendor == "postgresql":
        pgconn = getattr(raw, "pgconn", None)
        if pgconn is not None:  # psycopg 3
            setting = pgconn.parameter_status(b"standard_conforming_strings")
        else:
            setting = (raw.get_parameter_status("standard_conforming_strings") or "").encode()
        return None if not setting else Quoting(backslash=setting != b"on")
    if connection.vendor == "mysql":
        status = _mysql_status(raw)
        flags = None if status is None else status()
        if flags is None:
            return None
        return Quoting(
            backslash=not flags & _SERVER_STATUS_NO_BACKSLASH_ESCAPES,
            ansi_quotes=bool(flags & _SERVER_STATUS_ANSI_QUOTES),
        )
    return Quoting(backslash=False)


def is_deadlock(exc: Exception) -> bool:
    """MySQL's deadlock (1213), which rolls back the whole transaction; its
    lock wait timeout (1205) rolls back only the statement."""
    args: tuple[Any, ...] = getattr(exc.__cause__ or exc, "args", ())
    return bool(args) and args[0] == 1213


def is_outage(exc: BaseException) -> bool:
    """Whether the database could not answer (Django's OperationalError or
    InterfaceError), rather than refuse what it was sent: a lock conflict
    is another transaction's doing, and PostgreSQL's class 3B (a savepoint
    that does not exist: released or rolled back past already) the work's."""
    if not isinstance(exc, OperationalError | InterfaceError) or is_lock_conflict(exc):
        return False
    cause = exc.__cause__ or exc
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    return not (isinstance(code, str) and code.startswith("3B"))


def is_lock_conflict(exc: Exception) -> bool:
    """A deadlock, a lock timeout or a serialization failure: another
    transaction holds what this one needs, and (on MySQL) the server may
    have rolled this one back."""
    cause = exc.__cause__ or exc
    if getattr(cause, "sqlstate", None) in _POSTGRES_LOCK_STATES:
        return True
    if getattr(cause, "pgcode", None) in _POSTGRES_LOCK_STATES:
        return True
    args = getattr(cause, "args", ())
    if args and args[0] in _MYSQL_LOCK_ERRORS:
        return True
    # SQLite: "database is locked", or "database table is locked" with a
    # shared cache (in-memory test databases).
    return "database is locked" in str(exc) or "database table is locked" in str(exc)


# Prototypes of our own, so that ctypes.pythonapi's shared ones stay as they are.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


@functools.cache
def _mariadb_get_info() -> Any:
    """``mariadb_get_info`` from the client library mysqlclient is linked
    with, or None when that is not MariaDB Connector/C."""
    try:
        driver = importlib.import_module("MySQLdb._mysql")
        function = ctypes.CDLL(driver.__file__).mariadb_get_info
    except (ImportError, OSError, AttributeError):
        return None
    function.restype = ctypes.c_char
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return function


def reports_transactions(vendor: str) -> bool:
    """Whether this process's driver for ``vendor`` reports its transaction
    status: every driver but a mysqlclient built against another library.
    (Without mysqlclient at all, Django refuses MySQL by itself.)"""
    if vendor != "mysql" or importlib.util.find_spec("MySQLdb") is None:
        return True
    return _mariadb_get_info() is not None
