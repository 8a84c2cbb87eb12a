"""Checks E012 (missing migration), E013 (header), E014 (lists), E015 (database)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.db import connections
from django.test.utils import override_settings

from idempotency_app import checks

MIGRATION = Path(checks.__file__).parent / "migrations" / "0001_initial.py"


def ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


def test_model_and_migrations_agree() -> None:
    """Fails whenever a model change ships without its migration."""
    assert checks.check_migrations() == []


def test_missing_migration_is_e012(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "stale_idempotency_migrations"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = MIGRATION.read_text()
    stale = "\n".join(line for line in source.splitlines() if "format_version" not in line)
    assert stale != source
    (package / "0001_initial.py").write_text(stale)
    monkeypatch.syspath_prepend(str(tmp_path))
    with override_settings(MIGRATION_MODULES={"idempotency_app": package.name}):
        messages = checks.check_migrations()
    assert ids(messages) == ["idempotency_app.E012"]
    assert "makemigrations --check idempotency_app" in (messages[0].hint or "")


def test_e012_is_silent_when_migrations_are_disabled() -> None:
    with override_settings(MIGRATION_MODULES={"idempotency_app": None}):
        assert checks.check_migrations() == []


def test_e012_only_for_this_app() -> None:
    other = [apps.get_app_config("auth")]
    with override_settings(MIGRATION_MODULES={"idempotency_app": "no.such.module"}):
        assert checks.check_migrations(app_configs=other) == []


@pytest.mark.parametrize("header", ["Idempotency Key", "", "Idempotency-Key:", 5, "Clé"])
def test_bad_header_is_e013(header: Any) -> None:
    with override_settings(IDEMPOTENCY={"HEADER": header}):
        assert ids(checks.check_header_and_lists()) == ["idempotency_app.E013"]


@pytest.mark.parametrize("header", ["Idempotency-Key", "X-Request-Id", "x_key"])
def test_good_header_passes(header: str) -> None:
    with override_settings(IDEMPOTENCY={"HEADER": header}):
        assert checks.check_header_and_lists() == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("METHODS", "POST"),
        ("METHODS", ["POST", ""]),
        ("STORE_HEADERS", "X-Trace"),
        ("FINGERPRINT_QUERY_PARAMS", [1]),
        ("FINGERPRINT_HEADERS", None),
    ],
)
def test_bad_list_is_e014(name: str, value: Any) -> None:
    with override_settings(IDEMPOTENCY={name: value}):
        messages = checks.check_header_and_lists()
    assert ids(messages) == ["idempotency_app.E014"]
    assert f"IDEMPOTENCY['{name}']" in messages[0].msg


def test_good_lists_pass() -> None:
    good = {
        "METHODS": ("POST", "PUT"),
        "STORE_HEADERS": ["X-Trace"],
        "FINGERPRINT_QUERY_PARAMS": [],
        "FINGERPRINT_HEADERS": ["X-Tenant"],
    }
    with override_settings(IDEMPOTENCY=good):
        assert checks.check_header_and_lists() == []


def test_not_a_dict_is_left_to_e001() -> None:
    with override_settings(IDEMPOTENCY=["HEADER"]):
        assert checks.check_header_and_lists() == []


def test_supported_database_passes() -> None:
    assert checks.check_database_vendor() == []


def test_unsupported_database_is_e015(monkeypatch: pytest.MonkeyPatch) -> None:
    dummy = {**connections.settings["default"], "ENGINE": "django.db.backends.dummy"}
    monkeypatch.setitem(connections.settings, "legacy", dummy)
    try:
        with override_settings(IDEMPOTENCY={"DATABASE_ALIAS": "legacy"}):
            messages = checks.check_database_vendor()
    finally:
        del connections["legacy"]
    assert ids(messages) == ["idempotency_app.E015"]
    assert "'legacy'" in messages[0].msg


def test_unknown_database_is_left_to_e010() -> None:
    with override_settings(IDEMPOTENCY={"DATABASE_ALIAS": "nowhere"}):
        assert checks.check_database_vendor() == []


def test_full_check_run_has_no_new_errors() -> None:
    """The project's own settings pass every check added here."""
    from django.core import checks as django_checks

    new_ids = {
        "idempotency_app.E012",
        "idempotency_app.E013",
        "idempotency_app.E014",
        "idempotency_app.E015",
    }
    assert new_ids.isdisjoint(ids(django_checks.run_checks()))


def test_safe_methods_in_methods_is_e017() -> None:
    with override_settings(IDEMPOTENCY={"METHODS": ["POST", "get"]}):
        messages = checks.check_header_and_lists()
    assert ids(messages) == ["idempotency_app.E017"]
    assert "GET" in messages[0].msg


def test_view_options_unsafe_with_the_settings_are_e018() -> None:
    from idempotency_app.decorators import idempotent

    @idempotent(lease=5)
    def lease_of_five(request: Any) -> None: ...

    def about_it() -> list[Any]:
        return [m for m in checks.check_view_options() if "lease_of_five" in m.msg]

    with override_settings(IDEMPOTENCY={"WAIT_FOR_IN_FLIGHT": 10}):
        messages = about_it()
    assert [m.id for m in messages] == ["idempotency_app.E018"]
    assert "WAIT_FOR_IN_FLIGHT" in messages[0].msg
    assert not about_it(), "safe with the default settings"


def test_atomic_requests_on_another_database_is_w004() -> None:
    from django.conf import settings

    default = settings.DATABASES["default"]
    databases = {"default": {**default, "ATOMIC_REQUESTS": True}, "idem": dict(default)}
    with override_settings(DATABASES=databases, IDEMPOTENCY={"DATABASE_ALIAS": "idem"}):
        assert ids(checks.check_transactions()) == ["idempotency_app.W004"]
    with override_settings(DATABASES=databases):
        assert ids(checks.check_transactions()) == []


def test_a_narrow_mysql_charset_is_w005() -> None:
    mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "x"}
    with override_settings(DATABASES={"default": mysql}):
        assert ids(checks.check_transactions()) == ["idempotency_app.W005"]
    wide = {**mysql, "OPTIONS": {"charset": "utf8mb4"}}
    with override_settings(DATABASES={"default": wide}):
        assert ids(checks.check_transactions()) == []


def test_a_mysql_driver_that_cannot_report_transactions_is_w010(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without MariaDB Connector/C under mysqlclient, the driver cannot say
    whether the work's transaction is still open: warned, naming the fix."""
    from idempotency_app.lifecycle import drivers

    pytest.importorskip("MySQLdb", reason="needs mysqlclient: pip install -e '.[mysql]'")
    mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "x", "OPTIONS": {"charset": "utf8mb4"}}
    with override_settings(DATABASES={"default": mysql}):
        assert ids(checks.check_transactions()) == [], "the driver here reports it"
        monkeypatch.setattr(drivers, "_mariadb_get_info", lambda: None)
        assert ids(checks.check_transactions()) == ["idempotency_app.W010"]
