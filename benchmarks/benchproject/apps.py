from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "benchmarks.benchproject"
    label = "bench"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from benchmarks.benchproject import whatif

        if "async-claim" in whatif.enabled():
            connection_created.connect(whatif.install)
