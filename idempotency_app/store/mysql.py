"""MySQL and MariaDB: a plain INSERT whose duplicate-key error is the
answer; on MariaDB 10.5+ the claim returns the row it met."""

from __future__ import annotations

import functools
from typing import Any

from django.db import IntegrityError, connections

from idempotency_app.conf import MAX_REPLAY_CACHE
from idempotency_app.store import base
from idempotency_app.store.base import CLAIMED, Claimed, Existing, Identity

# MySQL's duplicate-key error: the one error a claim's INSERT expects.
DUPLICATE_KEY = 1062


def narrow_charset(settings_dict: dict[str, Any]) -> str | None:
    """The connection character set a MySQL database entry asks for, when it
    is not utf8mb4 (Django's default is utf8, which is utf8mb3)."""
    charset = str(dict(settings_dict.get("OPTIONS") or {}).get("charset", "utf8")).lower()
    return None if charset == "utf8mb4" else charset


class Backend(base.Backend):
    vendor = "mysql"

    def __init__(self, using: str) -> None:
        super().__init__(using)
        # Through a connection that is not utf8mb4, characters outside the
        # Basic Multilingual Plane turn into "?": two keys would collide.
        self.narrow = narrow_charset(connections[using].settings_dict) is not None
        # A plain INSERT whose duplicate-key error is caught: INSERT IGNORE
        # would also turn data errors into warnings and claim a mangled key.
        self.claim_sql = f"{self.insert_into} VALUES ({self.claim_values})"
        # MariaDB 10.5+ returns the row an ON DUPLICATE KEY UPDATE met: the
        # claim and the read of a taken key in one round trip. Outside a
        # transaction only: the no-op update write-locks the existing row,
        # which a transaction would hold (and serialise replays) until it ends.
        pk = self.quote("id")
        self.claim_alone_sql = (
            f"{self.claim_sql} ON DUPLICATE KEY UPDATE {pk} = {pk} "
            f"RETURNING {self.existing_columns}"
        )
        # A consistent read inside a transaction uses its old snapshot and
        # would miss a row committed since; a locking read sees it.
        self.select_locking = self.select + " LOCK IN SHARE MODE"

    def check_storable(self, identity: Identity) -> None:
        if self.narrow and any(
            ord(ch) > 0xFFFF for ch in identity.scope + identity.key + identity.operation
        ):
            base.refuse_unstorable(identity, self.using)

    def claim(
        self, identity: Identity, token: str, ttl: float, lease: float, connection: Any = None
    ) -> Existing | Claimed | None:
        params = self.claim_params(identity, token, ttl, lease)
        if connection is None:
            connection = connections[self.using]
        if base.runs_alone(connection) and self.returns_rows():
            _, row = self.execute(self.claim_alone_sql, params, connection)
            return CLAIMED if row[0] == token else self.found(row, connection)
        try:
            self.execute(self.claim_sql, params, connection)
        except IntegrityError as exc:
            cause = exc.__cause__
            if not (cause is not None and cause.args and cause.args[0] == DUPLICATE_KEY):
                raise
            return self.fetch(identity, connection)
        return CLAIMED

    def fetch(self, identity: Identity, connection: Any = None) -> Existing | None:
        # Inside an atomic block (the claim's INSERT failed there) read the
        # latest row, locking it. Not merely with autocommit off: a duplicate
        # polling there would hold the row against the completion it waits for.
        locking = (connection or connections[self.using]).in_atomic_block
        _, row = self.execute(
            self.select_locking if locking else self.select,
            self.params(identity, soon=MAX_REPLAY_CACHE),
            connection,
        )
        return None if row is None else self.found(row, connection)

    @functools.cached_property
    def _returns_rows(self) -> bool:
        connection: Any = connections[self.using]  # the MySQL backend's wrapper
        return bool(connection.mysql_is_mariadb and connection.mysql_version >= (10, 5))

    def returns_rows(self) -> bool:
        """Whether the server is MariaDB 10.5 or newer (asked once per process)."""
        return self._returns_rows
