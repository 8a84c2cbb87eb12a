"""Attacks on the completion bound alone (ClientCursor.mogrify) and joined
behind the held RELEASE SAVEPOINTs, as the statement and as the function."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DatabaseError, connection, transaction

from idempotency_app.conf import conf
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import postgresql
from idempotency_app.store.base import CLAIMED, Identity, StoredResponse, parse_headers
from tests.savepoints import savepoint
from tests.store.conftest import complete_in_a_block
from tests.testapp.models import Charge

pytestmark = [pytest.mark.postgresql, pytest.mark.django_db(transaction=True)]

HEADERS = (
    ("X-Odd", "%s %(status)s %% ' '' \\ \\' $$ E'\\x00' \u00e9 \U0001f600 \x00 ; COMMIT; --"),
    ("Location", "/a?b=%20&c='d'"),
)


def bodies() -> list[bytes]:
    return [
        b"%s %(status)s %% ' \\ \x00" + bytes(range(256)),
        b"",
        bytes(range(256)) * (conf.MAX_BODY_BYTES // 256),
    ]


@pytest.fixture(params=["on", "off"], ids=["std-strings", "backslash-strings"])
def session(request: Any) -> Iterator[str]:
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute(f"SET standard_conforming_strings = {request.param}")
    try:
        yield request.param
    finally:
        connection.close()


@pytest.fixture(params=[False, True], ids=["statement", "function"])
def store(request: Any) -> postgresql.Backend:
    """The store, completing with the statement or with migration 0008's function."""
    s = postgresql.Backend("default")
    s.claims_by_function = True
    s.completes_by_function = request.param
    return s


@pytest.mark.parametrize("commit", [True, False])
def test_odd_responses_stored_exactly_behind_releases(
    store: postgresql.Backend, session: str, commit: bool, key: str
) -> None:
    s = store
    seen: list[tuple[Any, Any]] = []

    def recorder(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
        seen.append((sql, params))
        return execute(sql, params, many, context)

    for n, body in enumerate(bodies()):
        identity = Identity("t'en\\ant%s", f"{key}-{n}", "op", "fp")
        assert s.claim(identity, "tok", 60, 30) is CLAIMED
        response = StoredResponse(201, HEADERS, body)
        seen.clear()
        with transaction.atomic():
            Charge.objects.create(label=f"{key}-{n}", amount=1)
            sids = [savepoint(), savepoint()]
            before = [f'RELEASE SAVEPOINT "{sid}"' for sid in reversed(sids)]
            with connection.execute_wrapper(recorder):
                assert s.complete(identity, "tok", response, 60, commit=commit, before=before)
        assert len(seen) == 1 and seen[0][1] is None, seen
        assert seen[0][0].startswith("RELEASE SAVEPOINT"), seen
        row = IdempotencyRecord.objects.get(key=identity.key)
        assert row.status == "completed"
        assert bytes(row.response_body) == body
        assert parse_headers(row.response_headers) == HEADERS
        assert Charge.objects.filter(label=f"{key}-{n}").count() == 1


@pytest.mark.parametrize("commit", [True, False])
def test_a_lost_claim_behind_releases_rolls_the_work_back(
    store: postgresql.Backend, session: str, commit: bool, key: str
) -> None:
    s = store
    identity = Identity("tenant", key, "op", "fp")
    assert s.claim(identity, "tok", 60, 30) is CLAIMED
    response = StoredResponse(201, HEADERS, b"%s body")
    with pytest.raises(DatabaseError) if commit else _no_error(), transaction.atomic():
        Charge.objects.create(label=key, amount=1)
        sid = savepoint()
        ok = s.complete(
            identity,
            "not-ours",
            response,
            60,
            commit=commit,
            before=[f'RELEASE SAVEPOINT "{sid}"'],
        )
        assert ok is False
        transaction.set_rollback(True)
    assert not Charge.objects.filter(label=key).exists()
    assert IdempotencyRecord.objects.get(key=key).status == "in_progress"


@pytest.mark.parametrize("commit", [True, False])
def test_a_refused_release_fails_the_work(
    store: postgresql.Backend, session: str, commit: bool, key: str
) -> None:
    s = store
    identity = Identity("tenant", key, "op", "fp")
    assert s.claim(identity, "tok", 60, 30) is CLAIMED
    response = StoredResponse(201, HEADERS, b"body")
    with pytest.raises(DatabaseError), transaction.atomic():
        Charge.objects.create(label=key, amount=1)
        sid = savepoint()
        s.complete(
            identity,
            "tok",
            response,
            60,
            commit=commit,
            before=[f'RELEASE SAVEPOINT "{sid}"', f'RELEASE SAVEPOINT "{sid}"'],
        )
    assert not Charge.objects.filter(label=key).exists()
    assert IdempotencyRecord.objects.get(key=key).status == "in_progress"


def test_a_latin1_session_completes_behind_releases(store: postgresql.Backend, key: str) -> None:
    s = store
    identity = Identity("tenant-\u00e9\u00fc", key, "op-\u00e9", "fp")
    connection.ensure_connection()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET client_encoding TO 'LATIN1'")
        assert s.claim(identity, "tok", 60, 30) is CLAIMED
        response = StoredResponse(201, HEADERS, b"%s \xe9")
        with transaction.atomic():
            sid = savepoint()
            assert s.complete(
                identity, "tok", response, 60, commit=True, before=[f'RELEASE SAVEPOINT "{sid}"']
            )
        found = s.claim(identity, "u", 60, 30)
        assert found.response == response  # type: ignore[union-attr]
    finally:
        connection.close()
    row = IdempotencyRecord.objects.get(key=key)
    assert row.scope == identity.scope and row.status == "completed"


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


def test_a_sql_ascii_session_completes_behind_releases_as_without(
    store: postgresql.Backend, key: str
) -> None:
    """psycopg sends str as UTF-8 where client_encoding is SQL_ASCII (no
    conversion: the bytes reach the UTF8 database as they are). Executed
    with its parameters, the completion stores a non-ASCII scope's record;
    bound alone by mogrify(), which decodes the bound query as ASCII, the
    same completion behind a release raises UnicodeDecodeError (not even a
    DatabaseError), so the request fails and its work rolls back, on every
    retry of the key."""
    s = store
    response = StoredResponse(201, (("X-A", "b"),), b"body")
    connection.ensure_connection()
    errors: dict[bool, Any] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET client_encoding TO 'SQL_ASCII'")
        for n, with_release in enumerate([False, True]):
            identity = Identity("tenant-\u00e9", f"{key}-{n}", "op", "fp")
            assert s.claim(identity, "tok", 60, 30) is CLAIMED
            try:
                assert complete_in_a_block(s, identity, response, with_release)
                errors[with_release] = None
            except Exception as exc:
                errors[with_release] = repr(exc)
    finally:
        connection.close()
    assert errors == {False: None, True: None}, errors
    done = IdempotencyRecord.objects.filter(key__startswith=key, status="completed")
    assert sorted(r.key for r in done) == [f"{key}-0", f"{key}-1"]


@pytest.mark.parametrize("std", ["on", "off"])
def test_the_completion_is_written_as_psycopg_writes_it(std: str) -> None:
    """``_bound`` writes each value the store sends as ``mogrify`` would, in
    either string syntax; what it does not write (a ``str`` subclass, a float
    that is not finite, text holding NUL) it leaves to ``mogrify``."""
    from hypothesis import given, settings, strategies as st

    connection.ensure_connection()
    raw = connection.connection
    with connection.cursor() as cursor:
        cursor.execute(f"SET standard_conforming_strings = {std}")
    mogrify = postgresql.base.kept_cursor(connection).mogrify
    sql = "SELECT %(text)s, %(body)s, 1-%(status)s, 1-%(expires)s, %(none)s"
    texts = st.text().filter(lambda t: "\x00" not in t)
    floats = st.floats(allow_nan=False, allow_infinity=False)

    @settings(max_examples=300, deadline=None)
    @given(texts, st.binary(), st.integers(-(2**63), 2**63 - 1), floats)
    def written_alike(text: str, body: bytes, status: int, expires: float) -> None:
        params = {"text": text, "body": body, "status": status, "expires": expires, "none": None}
        assert postgresql._bound(raw, sql, params) == mogrify(sql, params).encode()

    try:
        written_alike()

        class Member(str):
            pass

        for odd in (Member("a"), float("inf"), float("nan"), "a\x00b", True, 1.5j):
            assert postgresql._bound(raw, "SELECT %(v)s", {"v": odd}) is None, odd
    finally:
        connection.close()


@pytest.fixture
def through_libpq(monkeypatch: Any) -> list[int]:
    """Counts the completions sent through libpq's own call (``_bound``)."""
    calls: list[int] = []
    real = postgresql._complete_unseen

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(postgresql, "_complete_unseen", counting)
    return calls


@pytest.mark.parametrize("commit", [True, False])
def test_odd_responses_stored_exactly_through_libpq(
    store: postgresql.Backend, session: str, commit: bool, key: str, through_libpq: list[int]
) -> None:
    """With no execute wrapper the completion is written by ``_bound`` and
    sent through libpq: odd scopes, keys, statuses, headers and bodies are
    stored exactly, in either string syntax, behind releases."""
    statuses = [201, None, 599]
    for n, body in enumerate([*bodies(), b"\\x00", b"\\'"]):
        identity = Identity("t'en\\ant%s %(key)s -- \u00e9", f"{key}-{n}' ; COMMIT; --", "op", "fp")
        assert store.claim(identity, "t", 60, 30) is CLAIMED
        response = StoredResponse(statuses[n % 3], HEADERS, body)
        with transaction.atomic():
            Charge.objects.create(label=identity.key, amount=1)
            releases = [
                f'RELEASE SAVEPOINT "{sid}"' for sid in reversed([savepoint(), savepoint()])
            ]
            assert store.complete(identity, "t", response, 60, commit=commit, before=releases)
        row = IdempotencyRecord.objects.get(key=identity.key)
        assert (row.status, row.scope, row.response_status) == (
            "completed",
            identity.scope,
            response.status,
        )
        assert bytes(row.response_body) == body
        assert parse_headers(row.response_headers) == HEADERS
        assert Charge.objects.filter(label=identity.key).count() == 1
    assert len(through_libpq) == n + 1


def test_an_enum_status_goes_to_mogrify_and_is_stored_as_its_value(
    store: postgresql.Backend, key: str, through_libpq: list[int]
) -> None:
    """A view may set ``status_code`` to an ``HTTPStatus`` after making the
    response, and ``to_stored`` keeps it: not an ``int`` by type, ``_bound``
    leaves it to ``mogrify``, which writes its number."""
    import http

    identity = Identity("tenant", key, "op", "fp")
    assert store.claim(identity, "t", 60, 30) is CLAIMED
    with transaction.atomic():
        Charge.objects.create(label=key, amount=1)  # the work: the transaction is open
        response = StoredResponse(http.HTTPStatus.CREATED, (("X", "y"),), b"b")
        assert store.complete(identity, "t", response, 60, commit=True)
    assert IdempotencyRecord.objects.get(key=key).response_status == 201
    assert len(through_libpq) == 1
