"""SQL that hides a COMMIT or a write from a reader of its text, sent through
Django's own cursor on real servers: hex and escaped literals run by
EXECUTE IMMEDIATE, implicit commits in the middle of a text, a character set
in which a backslash falls inside a character, EXPLAIN options spelt with
escapes. Each must leave nothing committed, however often it is retried."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test.utils import override_settings
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient

from idempotency_app import idempotent, idempotent_task
from tests.conftest import post
from tests.testapp.models import AuditEntry, Charge, Tag

pytestmark = [
    pytest.mark.server_db,
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
]

AUDIT, CHARGE = AuditEntry._meta.db_table, Charge._meta.db_table
CHAIN_HEX = b"COMMIT AND CHAIN".hex()


@api_view(["POST"])
@idempotent
def charge(request: Request) -> Response:
    Charge.objects.create(label="debit", amount=-100)
    with connections[request.data.get("alias", "default")].cursor() as cursor:
        for sql in request.data["sql"]:
            cursor.execute(sql)
    # Released for a retry: safe only when nothing of the work committed.
    return Response({"detail": "provider unavailable"}, status=503)


urlpatterns = [path("charge/", charge)]


@pytest.fixture(autouse=True)
def _urls() -> Any:
    with override_settings(ROOT_URLCONF=__name__):
        yield


def committed() -> tuple[int, int]:
    """Debits committed on the records' database, rows on the other one."""
    return Charge.objects.filter(label="debit").count(), AuditEntry.objects.using("other").count()


def three_tries(client: APIClient, key: str, body: dict[str, Any]) -> list[int]:
    return [post(client, "/charge/", body, key).status_code for _ in range(3)]


def needs(vendor: str) -> None:
    if connection.vendor != vendor:
        pytest.skip(f"{vendor} SQL")


@pytest.mark.parametrize(
    "sql",
    [
        [f"EXECUTE IMMEDIATE x'{CHAIN_HEX}'"],
        [f"PREPARE s FROM x'{CHAIN_HEX}'", "EXECUTE s"],
        ["EXECUTE IMMEDIATE 'C\\OMMIT AND CHAIN'"],
        ["PREPARE s FROM 'C\\OMMIT AND CHAIN'", "EXECUTE s"],
        ["SET NAMES gbk", "SELECT '\u4e2d\\'; COMMIT AND CHAIN; -- '"],
        [f"SELECT 1; SET DEFAULT ROLE NONE; SELECT COUNT(*) FROM {CHARGE}"],
        [f"SELECT 1; CREATE TEMPORARY SEQUENCE s1; SELECT COUNT(*) FROM {CHARGE}"],
        [f"SELECT 1; SET `autocommit` = 1; SET `autocommit` = 0; SELECT COUNT(*) FROM {CHARGE}"],
        ["SET DEFAULT ROLE NONE"],
        ["CREATE TEMPORARY SEQUENCE s1"],
    ],
)
def test_mariadb_work_never_commits_on_a_retried_request(
    quiet_api: APIClient, key: str, sql: list[str]
) -> None:
    needs("mysql")
    statuses = three_tries(quiet_api, key, {"sql": sql})
    assert statuses == [500, 500, 500]
    assert committed() == (0, 0)


def test_mariadb_write_behind_a_character_set_change_is_refused(
    quiet_api: APIClient, key: str
) -> None:
    needs("mysql")
    sql = ["SET NAMES gbk", f"SELECT '\u4e2d\\'; INSERT INTO {AUDIT} (note) VALUES ('x'); -- '"]
    three_tries(quiet_api, key, {"alias": "other", "sql": sql})
    assert committed() == (0, 0)


def test_mariadb_task_with_a_hex_commit_is_refused(db: Any) -> None:
    needs("mysql")
    calls: list[int] = []

    @idempotent_task(key=lambda event: event["id"], scope="provider:acme")
    def apply(event: dict[str, str]) -> None:
        calls.append(1)
        Charge.objects.create(label="debit", amount=-100)
        with connection.cursor() as cursor:
            cursor.execute(f"EXECUTE IMMEDIATE x'{CHAIN_HEX}'")

    for _ in range(3):
        with pytest.raises(Exception, match="EXECUTE IMMEDIATE of SQL the guard cannot read"):
            apply({"id": "evt_1"})
    assert committed() == (0, 0)


YEN_SPLIT = "SELECT E'\u00a5''; COMMIT AND CHAIN; --'"


@pytest.mark.parametrize(
    ("alias", "sql"),
    [
        ("default", ["SET client_encoding = 'EUC_JP'", YEN_SPLIT]),
        ("default", ["SELECT set_config('client_encoding', 'SJIS', false)", YEN_SPLIT]),
        ("other", [f"EXPLAIN (U&\"\\0061nalyze\") INSERT INTO {AUDIT} (note) VALUES ('x')"]),
        (
            "other",
            [
                "SET client_encoding = 'EUC_JP'",
                f"SELECT E'\u00a5''; INSERT INTO {AUDIT} (note) VALUES ('x'); --'",
            ],
        ),
    ],
)
def test_postgresql_work_commits_only_with_its_outcome(
    quiet_api: APIClient, key: str, alias: str, sql: list[str]
) -> None:
    needs("postgresql")
    statuses = three_tries(quiet_api, key, {"alias": alias, "sql": sql})
    assert statuses == [500, 500, 500]
    assert committed() == (0, 0)


# -- a rollback the server made, which the work then hides from Django ------------

LOCKS: dict[str, threading.Event] = {}


def rival() -> None:
    """Locks b then a, against the view's a then b: one of the two deadlocks;
    its bigger transaction makes the view the victim."""
    try:
        with transaction.atomic():
            Charge.objects.bulk_create([Charge(label="rival") for _ in range(50)])
            Tag.objects.select_for_update().get(name="b")
            LOCKS["b"].set()
            LOCKS["a"].wait(5)
            Tag.objects.select_for_update().get(name="a")
    except OperationalError:
        pass
    finally:
        connections.close_all()


@api_view(["POST"])
@idempotent
def deadlocking(request: Request) -> Response:
    Charge.objects.create(label="debit", amount=-100)
    Tag.objects.select_for_update().get(name="a")
    LOCKS["a"].set()
    LOCKS["b"].wait(5)
    time.sleep(0.3)
    try:
        Tag.objects.select_for_update().get(name="b")  # MariaDB rolls everything back
    except OperationalError:
        transaction.set_rollback(False)  # discouraged, and it must not make a success
    Charge.objects.create(label="fee", amount=-1)
    return Response({"ok": True}, status=201)


urlpatterns.append(path("deadlock/", deadlocking))


def test_mariadb_a_deadlock_the_work_hid_is_no_stored_success(
    quiet_api: APIClient, key: str
) -> None:
    needs("mysql")
    Tag.objects.bulk_create([Tag(name="a"), Tag(name="b")])
    LOCKS.update(a=threading.Event(), b=threading.Event())
    thread = threading.Thread(target=rival)
    thread.start()
    response = post(quiet_api, "/deadlock/", {}, key)
    thread.join()
    debits = Charge.objects.filter(label="debit").count()
    if debits:
        pytest.skip("the rival was the deadlock's victim this time")
    assert response.status_code == 500
    assert response.json()["code"] == "request_rolled_back"
    assert Charge.objects.filter(label="fee").count() == 0
