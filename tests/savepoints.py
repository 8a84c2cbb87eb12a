"""Django's ``transaction.savepoint()``, which Django 6.1 renames
``savepoint_create()`` (the old name warns, and is removed in 2028)."""

from __future__ import annotations

from django.db import transaction

savepoint = getattr(transaction, "savepoint_create", None) or transaction.savepoint
