from __future__ import annotations

from django.urls import path

from benchmarks.benchproject import views

urlpatterns = [
    path("floor/", views.floor),
    path("plain/", views.plain),
    path("idem/", views.idem),
    path("library/", views.library),
]
