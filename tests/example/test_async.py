"""The example project's async charge endpoint, and the example served by
uvicorn (its receipt task is tested with the webhook, in
test_example_webhooks.py)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.test.utils import override_settings
from rest_framework.test import APIClient

from tests import servers
from tests.asgi_server import spawn
from tests.conftest import claims, post

pytest.importorskip("adrf", reason="needs adrf: pip install -e '.[test]'")

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def account(user: Any) -> Any:
    from example_project.payments.models import Account

    return Account.objects.create(owner=user, name="main", balance=0)


def url(account: Any) -> str:
    return f"/api/accounts/{account.pk}/async-charges/"


def example_urls() -> Any:
    return override_settings(ROOT_URLCONF="example_project.urls")


def test_the_async_charge_runs_once_and_replays(api: APIClient, account: Any, key: str) -> None:
    with example_urls():
        first = post(api, url(account), {"amount": 250, "description": "beans"}, key)
        again = post(api, url(account), {"amount": 250, "description": "beans"}, key)
        missing = post(api, url(account), {"amount": 250}, None)
    assert first.status_code == 201 and first["Location"].startswith("/api/charges/")
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert missing.status_code == 400 and missing.json()["code"] == "idempotency_key_missing"
    account.refresh_from_db()
    assert account.balance == -250 and account.charges.count() == 1


def test_an_invalid_async_charge_rolls_back(api: APIClient, account: Any, key: str) -> None:
    with example_urls():
        response = post(api, url(account), {"amount": 0}, key)
    assert response.status_code == 400
    account.refresh_from_db()
    assert account.charges.count() == 0 and not claims().exists()


def test_the_example_serves_under_uvicorn(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn", reason="needs uvicorn: pip install -e '.[test]'")
    env = servers.python_env(
        {
            "DJANGO_SETTINGS_MODULE": "example_project.settings",
            "EXAMPLE_SQLITE_PATH": str(tmp_path / "example.sqlite3"),
        }
    )
    for command in (["migrate", "-v", "0"], ["seed_demo"]):
        done = subprocess.run(
            [sys.executable, "manage.py", *command], cwd=servers.ROOT, env=env,
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    port = servers.free_port()
    log = tmp_path / "uvicorn.log"
    command = [
        sys.executable, "-m", "uvicorn", "example_project.asgi:application",
        "--host", servers.HOST, "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    process = spawn(command, env, log)
    try:
        servers._wait_until(lambda: servers._port_open(port), "uvicorn", log, process)
        base = f"http://{servers.HOST}:{port}"
        key = str(uuid.uuid4())
        auth = ("alice", "alice")
        answers = [
            servers.post(base, "/api/accounts/1/async-charges/", {"amount": 100}, key, auth=auth)
            for _ in range(2)
        ]
        sync = servers.post(base, "/api/accounts/1/charges/", {"amount": 100}, key + "s", auth=auth)
    finally:
        servers._stop_process(process, grace=10)
    assert [a.status for a in answers] == [201, 201], [a.body for a in answers]
    assert answers[1].headers.get("Idempotent-Replayed") == "true"
    assert answers[1].body == answers[0].body
    assert sync.status == 201
