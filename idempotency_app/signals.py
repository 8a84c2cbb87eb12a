"""Signals for dashboards and alerts; each is sent with ``identity``.

``replayed`` (a stored response was served), ``conflict`` (a duplicate found
the key in progress), ``mismatch`` (the key was reused for another request),
``takeover`` (a lapsed claim was taken over), ``guard_hit`` (a cached
validation error was served) and ``executed`` (a view ran under a claim;
also sent with ``status``, its response status).
"""

from __future__ import annotations

from django.dispatch import Signal

replayed = Signal()
conflict = Signal()
mismatch = Signal()
takeover = Signal()
guard_hit = Signal()
executed = Signal()
