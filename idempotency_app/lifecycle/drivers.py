"""What each database driver reports about its connection: whether a
transaction is open, read from the driver after every statement, with no
round trip.

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

import ctypes
import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

TransactionProbe = Callable[[], bool | None]

# libpq's PQTRANS_IDLE: no transaction open (the others are active, in a
# transaction, in a failed one, or a connection gone bad).
_PQ_IDLE = 0
# MariaDB Connector/C: enum mariadb_value's MARIADB_CONNECTION_SERVER_STATUS,
# and the server status flag SERVER_STATUS_IN_TRANS.
_MARIADB_CONNECTION_SERVER_STATUS = 30
_SERVER_STATUS_IN_TRANS = 1


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


def _mysql_probe(raw: Any) -> TransactionProbe | None:
    get_info = _mariadb_get_info()
    native = getattr(raw, "_get_native_connection", None)
    if get_info is None or native is None:
        return None
    capsule = native()
    pointer = _capsule_pointer(capsule, _capsule_name(capsule))
    status = ctypes.c_uint()
    reference = ctypes.byref(status)

    def probe() -> bool | None:
        # The MYSQL struct lives inside the driver's connection object, which
        # this closure keeps alive; a closed connection's status is stale.
        if not raw.open:
            return None
        get_info(pointer, _MARIADB_CONNECTION_SERVER_STATUS, reference)
        return bool(status.value & _SERVER_STATUS_IN_TRANS)

    return probe


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
