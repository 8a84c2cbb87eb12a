from __future__ import annotations

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "idempotency_app"
    verbose_name = "Idempotency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import request_finished

        from idempotency_app import checks  # noqa: F401  (registers the checks)
        from idempotency_app.sweep import sweep_after_request

        request_finished.connect(sweep_after_request, dispatch_uid="idempotency_app.auto_sweep")
