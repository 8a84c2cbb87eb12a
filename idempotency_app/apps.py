from __future__ import annotations

from django.apps import AppConfig


class IdempotencyConfig(AppConfig):
    name = "idempotency_app"
    verbose_name = "Idempotency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from importlib.util import find_spec

        from django.apps import apps
        from django.core.checks import Tags, register
        from django.core.signals import request_finished
        from django.db.backends.signals import connection_created

        from idempotency_app import checks, problems  # noqa: F401  (registers the checks)
        from idempotency_app.sweep import sweep_after_request
        from idempotency_app.work import guard_raw_cursors

        request_finished.connect(sweep_after_request, dispatch_uid="idempotency_app.auto_sweep")
        connection_created.connect(guard_raw_cursors, dispatch_uid="idempotency_app.raw_cursors")
        # Optional integrations, each imported only where its library is.
        if apps.is_installed("corsheaders"):
            from idempotency_app.cors import check_cors_headers

            register(check_cors_headers, Tags.security)
        if find_spec("prometheus_client") is not None:
            from idempotency_app import metrics  # noqa: F401  (connects the counters)
