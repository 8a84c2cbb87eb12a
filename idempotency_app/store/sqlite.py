"""SQLite: INSERT ... ON CONFLICT DO NOTHING, then a read when it lost."""

from __future__ import annotations

from typing import Any

from idempotency_app.store import base
from idempotency_app.store.base import CLAIMED, Claimed, Existing, Identity


class Backend(base.Backend):
    vendor = "sqlite"

    def __init__(self, using: str) -> None:
        super().__init__(using)
        scope, key = self.quote("scope"), self.quote("key")
        self.claim_sql = (
            f"{self.insert_into} VALUES ({self.claim_values}) "
            f"ON CONFLICT ({scope}, {key}) DO NOTHING"
        )

    def claim(
        self, identity: Identity, token: str, ttl: float, lease: float, connection: Any = None
    ) -> Existing | Claimed | None:
        params = self.claim_params(identity, token, ttl, lease)
        rowcount, _ = self.execute(self.claim_sql, params, connection)
        return CLAIMED if rowcount == 1 else self.fetch(identity, connection)

    def renews_in_place(self) -> bool:
        """One writer: a second connection would wait for the work anyway."""
        return True
