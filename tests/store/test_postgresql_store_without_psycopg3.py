"""A project on psycopg2 has no ``psycopg`` to import: the PostgreSQL store
must still load, and send its statements through Django's cursor (every
path past the cursor asks for psycopg 3's own connection first)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_the_store_loads_and_stays_behind_the_cursor_without_psycopg() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["psycopg"] = None  # import psycopg raises ImportError

        import django
        django.setup()
        from idempotency_app.store import postgresql

        assert postgresql.pq is None
        assert postgresql._psycopg_connection() is None

        class Psycopg2Connection:  # what Django's connection holds on psycopg2
            pass

        class Wrapper:
            connection = Psycopg2Connection()

        assert postgresql.unseen_by_agents(Wrapper()) is False
        print("ok")
        """
    )
    env = {
        **{
            name: value for name, value in os.environ.items() if not name.startswith("IDEMPOTENCY_")
        },
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
