from __future__ import annotations

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "idempotency_app"
    verbose_name = "Idempotency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from importlib.util import find_spec

        from django.core.signals import request_finished
        from django.db.backends.signals import connection_created

        from idempotency_app import checks
        from idempotency_app.lifecycle.work import guard_raw_cursors
        from idempotency_app.sweep import sweep_after_request

        request_finished.connect(sweep_after_request, dispatch_uid="idempotency_app.auto_sweep")
        connection_created.connect(guard_raw_cursors, dispatch_uid="idempotency_app.raw_cursors")
        checks.register_all()
        # Optional integrations, each imported only where its library is.
        if find_spec("prometheus_client") is not None:
            from idempotency_app.integrations import metrics  # noqa: F401  (connects the counters)
