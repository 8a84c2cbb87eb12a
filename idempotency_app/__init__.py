"""Idempotency keys for Django REST Framework."""

__version__ = "0.1.0"
