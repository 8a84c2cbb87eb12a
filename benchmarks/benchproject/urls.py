from __future__ import annotations

from django.urls import path
from rest_framework.decorators import api_view

from benchmarks.benchproject import views
from idempotency_app.decorators import idempotent  # where earlier checkouts (--baseline) have it

urlpatterns = [
    path("floor/", views.floor),
    path("plain/", views.plain),
    path("idem/", api_view(["POST"])(idempotent(views.write))),
    path("least-replay/", views.least_replay),
    path("library/", views.library),
]
