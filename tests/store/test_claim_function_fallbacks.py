"""Attacks on the completion bound alone behind releases, in every client
encoding, and on the claim's fallback to its statement when the function
is gone or cannot be called (a migration back, EXECUTE revoked, a
search_path without it, pipeline mode, a caller's transaction)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import apps
from django.db import DatabaseError, connection, transaction

from idempotency_app import service
from idempotency_app.exceptions import StoreUnavailable
from idempotency_app.models import IdempotencyRecord
from idempotency_app.store import backend, postgresql
from idempotency_app.store.base import CLAIMED, Existing, Identity, StoredResponse, parse_headers
from tests.savepoints import savepoint
from tests.store.conftest import MIGRATION, complete_in_a_block, restore
from tests.testapp.models import Charge

pytestmark = [pytest.mark.postgresql, pytest.mark.django_db(transaction=True)]

SIG = "idempotency_claim_v1(text,text,text,text,text,float8,float8,float8,float8,boolean)"


def _store(by_function: bool | None = True) -> postgresql.Backend:
    s = postgresql.Backend("default")
    s.claims_by_function = by_function
    return s


@pytest.fixture
def restore_function() -> Iterator[None]:
    try:
        yield
    finally:
        restore(MIGRATION)


# --- 1. _joined(): other client encodings -------------------------------------

# Per encoding: text it can encode, with the bytes that are ASCII trail bytes
# in multibyte encodings (0x5C backslash, 0x27 never, 0x7C etc.).
ENCODINGS = {
    "EUC_JP": "\u8868\u30bd\u80fd\u6f22 \u00a7",
    "SJIS": "\u8868\u30bd\u80fd\u5341\u7533",  # 0x955C 0x835C 0x945C ... trail byte '\'
    "BIG5": "\u529f\u8a31\u84cb",  # 0xA55C 0xB35C ...
    "GBK": "\u6f22\u5b57\u4e02",
    "GB18030": "\u6f22\u5b57\U0001f600",
    "UHC": "\ud55c\uad6d\uc5b4",
    "WIN1252": "\u20ac\u201c\u00e9\u0160",
    "LATIN1": "\u00e9\u00fc\u00ff",
    "EUC_KR": "\ud55c\uad6d",
    "WIN1251": "\u0416\u0436",
    "KOI8R": "\u0416\u0436",
}


@pytest.mark.parametrize("std", ["on", "off"])
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_other_client_encodings_complete_behind_releases_exactly(
    encoding: str, std: str, key: str
) -> None:
    text = ENCODINGS[encoding]
    s = _store()
    identity = Identity(f"t{text}'\\%s", key, f"op{text}", "fp")
    headers = (("X-A", f"{text} ' \\ %s %(x)s"), ("X-B", text + "\\"))
    response = StoredResponse(201, headers, text.encode("utf-8") + b"\\'%s")
    connection.ensure_connection()
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SET client_encoding TO '{encoding}'")
            cursor.execute(f"SET standard_conforming_strings = {std}")
        assert s.claim(identity, "tok", 60, 30) is CLAIMED
        with transaction.atomic():
            Charge.objects.create(label=key, amount=1)
            sid = savepoint()
            assert s.complete(
                identity, "tok", response, 60, commit=True, before=[f'RELEASE SAVEPOINT "{sid}"']
            )
        found = s.claim(identity, "u", 60, 30)
        assert isinstance(found, Existing) and found.response == response, found
    finally:
        connection.close()
    row = IdempotencyRecord.objects.get(key=key)
    assert row.scope == identity.scope and row.status == "completed"
    assert parse_headers(row.response_headers) == headers
    assert Charge.objects.filter(label=key).count() == 1


@pytest.mark.parametrize("commit", [True, False])
def test_sql_ascii_fallback_with_non_ascii_body_headers_and_std_off(commit: bool, key: str) -> None:
    """The fallback (joined text + params) under SQL_ASCII, with backslash
    strings off: a value with '%' and quotes, non-ASCII everywhere."""
    s = _store()
    identity = Identity("t\u00e9%s", key, "op\u00fc", "fp")
    headers = (("X-A", "\u00e9 %s %(a)s ' \\"),)
    response = StoredResponse(201, headers, bytes(range(256)))
    connection.ensure_connection()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET client_encoding TO 'SQL_ASCII'")
            cursor.execute("SET standard_conforming_strings = off")
        assert s.claim(identity, "tok", 60, 30) is CLAIMED
        with transaction.atomic():
            Charge.objects.create(label=key, amount=1)
            sids = [savepoint(), savepoint()]
            assert s.complete(
                identity,
                "tok",
                response,
                60,
                commit=commit,
                before=[f'RELEASE SAVEPOINT "{sid}"' for sid in reversed(sids)],
            )
    finally:
        connection.close()
    row = IdempotencyRecord.objects.get(key=key)
    assert row.status == "completed" and bytes(row.response_body) == response.body
    assert parse_headers(row.response_headers) == headers
    assert Charge.objects.filter(label=key).count() == 1


# --- 2. the fallback to the statement ----------------------------------------


def test_drop_inside_a_caller_transaction_fails_once(
    function_dropped: postgresql.Backend, key: str
) -> None:
    """42883 inside transaction.atomic(): the claim fails as an outage (the
    failed call spoiled the caller's transaction), the transaction is marked
    for rollback, and every later claim sends the statement."""
    store_ = function_dropped
    with pytest.raises(StoreUnavailable), transaction.atomic():
        Charge.objects.create(label=key, amount=1)
        try:
            service.claim("attack:drop", key, "op")
        finally:
            # a second decorated call in the same (aborted) transaction
            assert store_.claims_by_function is False
            with pytest.raises(StoreUnavailable):
                service.claim("attack:drop", key + "-b", "op")
            assert store_.claims_by_function is False
    assert not Charge.objects.filter(label=key).exists()
    held = service.claim("attack:drop", key, "op")
    assert isinstance(held, service.Held)
    service.complete(held, {"ok": 1})
    assert store_.claims_by_function is False


@pytest.mark.parametrize("prepare", [None, 0], ids=["text", "prepared"])
def test_migrate_back_and_forward_between_claims(
    restore_function: None, prepare: int | None, key: str
) -> None:
    """0007 reversed and re-applied between two claims on the same open
    connection (a plpgsql function with a new OID, prepared statement kept):
    no claim may fail."""
    options = {} if prepare is None else {"prepare_threshold": prepare}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(connection.settings_dict, "OPTIONS", options)
        connection.close()
        s = postgresql.Backend("default")
        for n in range(6):
            assert s.claim(Identity("t", f"{key}-{n}", "op", "fp"), "t", 60, 30) is CLAIMED
        assert s.claims_by_function is True
        with connection.schema_editor() as editor:
            MIGRATION._drop(apps, editor)
            MIGRATION._create(apps, editor)
        for n in range(6, 12):
            assert s.claim(Identity("t", f"{key}-{n}", "op", "fp"), "t", 60, 30) is CLAIMED
        connection.close()


def test_pipeline_mode_falls_back_after_undefined_function(
    restore_function: None, key: str
) -> None:
    """In psycopg pipeline mode the error surfaces at fetchone(), not at
    execute(): the fallback must see it there too."""
    s = _store(True)
    # control: with the function present, claims work in pipeline mode
    connection.ensure_connection()
    with connection.connection.pipeline():
        assert s.claim(Identity("t", key + "-c", "op", "fp"), "t", 60, 30) is CLAIMED
    with connection.schema_editor() as editor:
        MIGRATION._drop(apps, editor)
    outcomes: list[Any] = []
    try:
        for n in range(3):
            connection.close()
            connection.ensure_connection()
            try:
                with connection.connection.pipeline():
                    r = s.claim(Identity("t", f"{key}-{n}", "op", "fp"), "t", 60, 30)
                    outcomes.append("claimed" if r is CLAIMED else repr(r))
            except DatabaseError as exc:
                outcomes.append(type(exc).__name__)
    finally:
        connection.close()
    assert outcomes[1:] == ["claimed", "claimed"], (outcomes, s.claims_by_function)


def test_execute_revoked_falls_back_to_the_statement(restore_function: None, key: str) -> None:
    """A hardened database (ALTER DEFAULT PRIVILEGES ... REVOKE EXECUTE ON
    FUNCTIONS FROM PUBLIC): the function exists but the app's role may not
    call it; the lookup says so, and a call that fails with 42501 falls
    back to the statement like a missing function."""
    role = "claim_attack_role"
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"DROP ROLE IF EXISTS {role}")
        cursor.execute(f"CREATE ROLE {role}")
        cursor.execute(f'GRANT ALL ON TABLE "{table}" TO {role}')
        cursor.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}")
        cursor.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        cursor.execute(f"REVOKE EXECUTE ON FUNCTION {SIG} FROM PUBLIC")
    store_ = backend("default")
    store_.claims_by_function = None
    statuses = []
    try:
        connection.close()
        connection.ensure_connection()
        with connection.cursor() as cursor:
            cursor.execute(f"SET ROLE {role}")
        # the statement form works for this role
        assert _store(False).claim(Identity("t", key + "-s", "op", "fp"), "t", 60, 30) is CLAIMED
        for n in range(3):
            try:
                held = service.claim("attack:revoked", f"{key}-{n}", "op")
                service.complete(held, {"ok": 1})
                statuses.append("ok")
            except StoreUnavailable as exc:
                statuses.append(f"503: {exc}"[:80])
    finally:
        connection.close()
        with connection.cursor() as cursor:
            cursor.execute(f"GRANT EXECUTE ON FUNCTION {SIG} TO PUBLIC")
            cursor.execute(f"DROP OWNED BY {role}")
            cursor.execute(f"DROP ROLE IF EXISTS {role}")
        connection.close()
    assert statuses == ["ok", "ok", "ok"], statuses


@pytest.fixture
def tenant_only_schema() -> Iterator[str]:
    schema = "claim_attack_tenant"
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        cursor.execute(f"CREATE SCHEMA {schema}")
        cursor.execute(f'CREATE TABLE {schema}."{table}" (LIKE public."{table}" INCLUDING ALL)')
    try:
        yield schema
    finally:
        connection.close()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        connection.close()


def test_a_tenant_only_search_path_after_a_public_lookup(tenant_only_schema: str, key: str) -> None:
    """Schema per tenant without public in search_path, the function in
    public only, the public schema's requests and a tenant's alternating on
    one connection: the tenant's first claim falls back to the statement,
    which serves both from then on (no request fails)."""
    s = postgresql.Backend("default")
    results = []
    try:
        for n in range(4):
            for path in ("public", tenant_only_schema):
                with connection.cursor() as cursor:
                    cursor.execute(f"SET search_path TO {path}")
                try:
                    r = s.claim(Identity("t", f"{key}-{n}", "op", "fp"), "t", 60, 30)
                    results.append((path, "claimed" if r is CLAIMED else repr(r)))
                except DatabaseError as exc:
                    results.append((path, type(exc).__name__))
    finally:
        connection.close()
    assert [r for r in results if r[1] != "claimed"] == [], results


def test_store_functions_none_before_connecting(key: str) -> None:
    connection.close()
    s = postgresql.Backend("default")
    assert postgresql.store_functions(None) is None
    assert s.claim_statement(True) == s.claim_alone_sql and s.claims_by_function is None
    assert s.claim(Identity("t", key, "op", "fp"), "t", 60, 30) is CLAIMED
    assert s.claims_by_function is True


def test_threads_racing_through_the_reset_one_key(
    function_dropped: postgresql.Backend, key: str
) -> None:
    """The function dropped while the shared backend says True: 10 threads
    claim one key at once (each may hit 42883 and reset while others ask
    again). Never two winners; any thread that failed claims again fine."""
    import threading

    from tests.concurrency import in_threads

    store_ = function_dropped
    connection.close()
    identity = Identity("tenant", key, "op", "fp")
    lock = threading.Lock()
    counter = iter(range(100))

    def one() -> Any:
        with lock:
            n = next(counter)
        tok = f"tok{n}"
        out = []
        for _ in range(3):
            try:
                out.append((tok, store_.claim(identity, tok, 60, 30)))
                break
            except DatabaseError as exc:
                out.append((tok, type(exc).__name__))
        return out

    results = in_threads(10, one)
    assert not [r for r in results if isinstance(r, Exception)], results
    finals = [r[-1] for r in results]
    winners = [t for t, r in finals if r is CLAIMED]
    assert len(winners) == 1, results
    assert all(
        isinstance(r, Existing) and r.token == winners[0] for t, r in finals if r is not CLAIMED
    )
    assert all(len(r) <= 2 for r in results), results  # at most one failure each
    assert IdempotencyRecord.objects.filter(key=key).count() == 1
    assert store_.claims_by_function is False


@pytest.mark.parametrize("atomic_requests", [False, True])
@pytest.mark.parametrize("prepare", [None, 0], ids=["text", "prepared"])
def test_http_function_dropped_under_a_running_process(
    restore_function: None,
    quiet_api: Any,
    executions: list[int],
    atomic_requests: bool,
    prepare: int | None,
    key: str,
) -> None:
    """Through the view: after the migration back, a request whose claim runs
    alone claims with the statement at once; under ATOMIC_REQUESTS the first
    is a 503 with nothing committed (never 409/500). The work runs once and
    replays."""
    from tests.conftest import post

    options = {} if prepare is None else {"prepare_threshold": prepare}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
        patch.setitem(connection.settings_dict, "OPTIONS", options)
        connection.close()
        warm = post(quiet_api, "/charges/", {"label": "w"}, key + "-w")
        assert warm.status_code == 201
        assert backend("default").claims_by_function is True
        with connection.schema_editor() as editor:
            MIGRATION._drop(apps, editor)
        codes = [post(quiet_api, "/charges/", {"label": "a"}, key).status_code for _ in range(3)]
        connection.close()
    assert codes == ([503, 201, 201] if atomic_requests else [201, 201, 201]), codes
    assert Charge.objects.filter(label="a").count() == 1
    assert IdempotencyRecord.objects.get(key__endswith=key).status == "completed"


MORE_ENCODINGS = [
    "EUC_TW",
    "EUC_JIS_2004",
    "SHIFT_JIS_2004",
    "JOHAB",
    "WIN874",
    "WIN1258",
    "ISO_8859_5",
    "LATIN9",
    "WIN866",
    "EUC_CN",
    "LATIN2",
    "WIN1250",
]


@pytest.mark.parametrize("encoding", MORE_ENCODINGS)
def test_behind_releases_fails_only_where_without_fails(encoding: str, key: str) -> None:
    """Whatever the session's encoding: the completion behind releases
    (mogrify) stores what the completion alone (parameters) stores, and fails
    only where that fails."""
    s = _store()
    response = StoredResponse(201, (("X-A", "\u00e9 \u0416 \u8868 '\\ %s"),), b"\\%s")
    outcomes: dict[bool, Any] = {}
    connection.ensure_connection()
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"SET client_encoding TO '{encoding}'")
        for n, with_release in enumerate([False, True]):
            identity = Identity("tenant", f"{key}-{n}", "op", "fp")
            try:
                assert s.claim(identity, "tok", 60, 30) is CLAIMED
                complete_in_a_block(s, identity, response, with_release)
                row = IdempotencyRecord.objects.get(key=identity.key)
                outcomes[with_release] = (row.status, parse_headers(row.response_headers))
            except Exception as exc:
                outcomes[with_release] = type(exc).__name__
                connection.close()
                connection.ensure_connection()
                with connection.cursor() as cursor:
                    cursor.execute(f"SET client_encoding TO '{encoding}'")
    finally:
        connection.close()
    assert outcomes[True] == outcomes[False], outcomes


def test_reset_in_a_savepoint_then_claim_in_the_outer_transaction(
    function_dropped: postgresql.Backend, key: str
) -> None:
    """A nested decorated call fails with 42883 inside its own savepoint; the
    caller catches it and claims another key in the same (healthy, INTRANS)
    transaction: the lookup runs inside the caller's transaction and must
    neither spoil it nor stop the outer work from committing once."""
    store_ = function_dropped
    with transaction.atomic():
        Charge.objects.create(label=key, amount=1)
        with pytest.raises(StoreUnavailable), transaction.atomic():
            service.claim("attack:nest", key + "-inner", "op")
        assert store_.claims_by_function is False
        held = service.claim("attack:nest", key + "-outer", "op")
        assert isinstance(held, service.Held)
        service.complete(held, {"ok": 1})
        assert store_.claims_by_function is False
    assert Charge.objects.filter(label=key).count() == 1
    assert IdempotencyRecord.objects.get(key__endswith=key + "-outer").status == "completed"
    assert not IdempotencyRecord.objects.filter(key__endswith=key + "-inner").exists()
