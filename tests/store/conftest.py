"""What the PostgreSQL store's attack modules share: the store's functions
taken away under a running process, their bodies as the server keeps them,
and a completion with or without a release in front of it."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import apps
from django.db import connection, transaction

from idempotency_app.store import backend, postgresql
from idempotency_app.store.base import Identity, StoredResponse
from tests.savepoints import savepoint
from tests.testapp.models import Charge

MIGRATION = importlib.import_module("idempotency_app.migrations.0007_claim_function")


@contextlib.contextmanager
def dropped(migration: Any) -> Iterator[None]:
    """``migration``'s function dropped (a migration back before it), then
    created again by the migration itself, and asked for again by the
    process's store."""
    with connection.schema_editor() as editor:
        migration._drop(apps, editor)
    try:
        yield
    finally:
        restore(migration)


def restore(migration: Any) -> None:
    """``migration``'s function created again by the migration itself, and
    asked for again by the process's store."""
    connection.close()
    with connection.schema_editor() as editor:
        migration._create(apps, editor)
    backend("default").claims_by_function = None  # the rest of the run asks again
    connection.close()


def function_source(signature: str) -> str:
    """The body of the function of ``signature``, as the server keeps it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(%s)", [signature])
        (source,) = cursor.fetchone()
    return str(source)


@pytest.fixture
def function_dropped() -> Iterator[postgresql.Backend]:
    """The process's store, already claiming through the function, with the
    function then dropped (a migration back to 0006)."""
    store_ = backend("default")
    connection.ensure_connection()
    store_.claim_statement(True)
    assert store_.claims_by_function is True
    with dropped(MIGRATION):
        yield store_


def is_completion(sql: str) -> bool:
    """Whether ``sql`` is the completion sent with the COMMIT: the statement,
    or migration 0008's function."""
    return "WITH done AS (UPDATE" in sql or postgresql.COMPLETE_FUNCTION in sql


def complete_in_a_block(
    store: postgresql.Backend,
    identity: Identity,
    response: StoredResponse,
    with_release: bool,
    commit: bool = True,
) -> bool:
    """Complete ``identity`` (claimed with token "tok") after a write in an
    atomic block, whose inner savepoint's RELEASE goes in front of the
    completion, or was sent already."""
    with transaction.atomic():
        Charge.objects.create(label=identity.key, amount=1)
        sid = savepoint()
        if not with_release:
            transaction.savepoint_commit(sid)
        before = [f'RELEASE SAVEPOINT "{sid}"'] if with_release else []
        return store.complete(identity, "tok", response, 60, commit=commit, before=before)
