"""The bench views on the peer's server, where drf-idempotency's middleware
makes ``/idem/`` (the same undecorated ``write`` as ``/plain/``) idempotent.

Its per-view decorator does not work on this view either way round. Inside
``@api_view``, as its docstring shows, it renders the view's DRF
``Response`` before DRF has chosen a renderer: an AssertionError (a 500)
after the view has committed, with the key left in progress. Outside, its
409 for a key in progress escapes DRF's exception handling and becomes a
500. So the peer runs as its quick start sets it up: the middleware, which
answers 409 itself, and which, like the decorator outside ``@api_view``,
runs before DRF's authentication. Requests without the header (floor,
plain) pass through it untouched.
"""

from __future__ import annotations

import os
import sys

from django.http import HttpRequest, JsonResponse
from django.urls import path

from benchmarks.benchproject import views


def library(request: HttpRequest) -> JsonResponse:
    """Where the peer comes from, and proof that ours is not loaded here."""
    import drf_idempotency

    return JsonResponse(
        {
            "path": os.path.realpath(drf_idempotency.__file__),
            "version": drf_idempotency.__version__,
            "ours_loaded": "idempotency_app" in sys.modules,
            "pid": os.getpid(),
        }
    )


urlpatterns = [
    path("floor/", views.floor),
    path("plain/", views.plain),
    path("idem/", views.plain),
    path("library/", library),
]
