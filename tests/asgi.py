"""ASGI application serving tests.urls for the uvicorn races (see tests/asgi_server.py)."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.server_settings")

application = get_asgi_application()
