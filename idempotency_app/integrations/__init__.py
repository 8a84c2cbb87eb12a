"""Integrations with optional libraries, each importing its library and
imported only where it is installed: drf-spectacular (``openapi``) and
prometheus-client (``metrics``)."""
