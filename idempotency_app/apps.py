from __future__ import annotations

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "idempotency_app"
    verbose_name = "Idempotency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from idempotency_app import checks  # noqa: F401  (registers the checks)
