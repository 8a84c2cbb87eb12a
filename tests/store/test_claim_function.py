"""PostgreSQL: the claim as a PL/pgSQL function (migration 0007), which the
server plans once per session instead of once per claim.

The function must be the claim statement and nothing else, and a database
where the migration has not run must still claim correctly, with the
statement itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection, transaction

from idempotency_app.store import postgresql
from idempotency_app.store.base import CLAIMED, Existing, Identity
from tests.store.conftest import MIGRATION, dropped, function_source

pytestmark = pytest.mark.postgresql


def _compact(sql: str) -> str:
    return "".join(sql.split())


@pytest.mark.django_db
def test_the_function_runs_the_claim_statement_and_nothing_else() -> None:
    """Kept in step with the statement the store would send itself: a change
    to one without the other fails here (and the function's comment and its
    ``synchronous_commit`` switch are all it adds)."""
    store = postgresql.Backend("default")
    source = function_source(postgresql._CLAIM_SIGNATURE)
    query = source.split("RETURN QUERY", 1)[1].rsplit(";", 1)[0]
    statement = store.claim_sql
    for name in postgresql.CLAIM_ARGUMENTS:
        statement = statement.replace(f"%({name})s", f"_{name}")
    assert _compact(query) == _compact(statement)


@pytest.mark.django_db
@pytest.mark.parametrize(("alone", "expected"), [(True, "off"), (False, "on")])
def test_only_a_claim_alone_skips_the_flush_wait(alone: bool, expected: str, key: str) -> None:
    """Inside a caller's transaction the claim must leave its COMMIT
    synchronous; alone, the claim is the whole transaction."""
    store = postgresql.Backend("default")
    params = store.claim_params(Identity("tenant", key, "op", "fp"), "token", 60, 30)
    with connection.cursor() as cursor:
        cursor.execute(store.claim_calls[alone], params)
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone() == (expected,)


@pytest.fixture
def without_the_function() -> Iterator[None]:
    """As on a database still at migration 0006."""
    with dropped(MIGRATION):
        yield


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("without_the_function")
@pytest.mark.parametrize("in_a_transaction", [False, True])
def test_before_the_migration_the_store_sends_the_statement(
    in_a_transaction: bool, key: str
) -> None:
    store = postgresql.Backend("default")
    identity = Identity("tenant", key, "op", "fp")
    with transaction.atomic() if in_a_transaction else connection.cursor():
        assert store.claim(identity, "token", 60, 30) is CLAIMED
        found = store.claim(identity, "other", 60, 30)
    assert store.claims_by_function is False
    assert isinstance(found, Existing) and found.token == "token"
    assert store.claim_statement(True) == store.claim_alone_sql


@pytest.mark.django_db(transaction=True)
def test_the_store_asks_once_whether_the_function_exists(key: str) -> None:
    """One catalog lookup per process and alias, never seen by the query
    log (so the first request counts the statements every other one does),
    then the function for claims alone and in a transaction alike."""
    from django.test.utils import CaptureQueriesContext

    store = postgresql.Backend("default")
    asked: list[tuple[bool, bool] | None] = []
    real = postgresql.store_functions

    def counting(raw: object) -> tuple[bool, bool] | None:
        asked.append(real(raw))
        return asked[-1]

    identity = Identity("tenant", key, "op", "fp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(postgresql, "store_functions", counting)
        with CaptureQueriesContext(connection) as queries:
            assert store.claim(identity, "token", 60, 30) is CLAIMED
            with transaction.atomic():
                assert isinstance(store.claim(identity, "other", 60, 30), Existing)
    assert asked == [(True, True)]
    sent = [query["sql"] for query in queries.captured_queries]
    sent = [sql for sql in sent if sql not in ("BEGIN", "COMMIT")]  # the atomic block's
    assert len(sent) == 2 and all(postgresql.CLAIM_FUNCTION in sql for sql in sent), sent
    assert sent[0].endswith(", True)") and sent[1].endswith(", False)"), sent


@pytest.mark.django_db(transaction=True)
def test_a_lookup_that_cannot_run_is_asked_again(key: str) -> None:
    """In a transaction already failed the lookup cannot answer: the claim
    fails as it would anyway, and the next one asks again."""
    from django.db import DatabaseError

    store = postgresql.Backend("default")
    with transaction.atomic():
        with (
            pytest.raises(DatabaseError),
            transaction.atomic(savepoint=False),
            connection.cursor() as cursor,
        ):
            cursor.execute("SELECT 1/0")
        with pytest.raises(DatabaseError):
            store.claim(Identity("tenant", key, "op", "fp"), "token", 60, 30)
        assert store.claims_by_function is None
    assert store.claim(Identity("tenant", key, "op", "fp"), "token", 60, 30) is CLAIMED
    assert store.claims_by_function is True


@pytest.mark.django_db(transaction=True)
def test_a_store_asked_before_connecting_asks_again() -> None:
    """Asked with no connection open yet, the store cannot know: it sends
    the statement that once and asks when connected."""
    store = postgresql.Backend("default")
    connection.close()
    assert store.claim_statement(True) == store.claim_alone_sql
    assert store.claims_by_function is None
    connection.ensure_connection()
    assert store.claim_statement(True) == store.claim_calls[True]
