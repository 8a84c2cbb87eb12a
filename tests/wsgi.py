"""WSGI application serving tests.urls for fault tests (see tests/servers.py)."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.server_settings")

application = get_wsgi_application()
