from __future__ import annotations

from django.db import models


class IdempotencyRecord(models.Model):
    """One claimed idempotency key.

    The unique constraint on (key, scope) is the arbiter (key first, so the
    admin's search by key uses it): whoever inserts the
    row owns the key. ``token`` fences the owner, so a worker whose lease was
    taken over can no longer complete. The request body is never stored,
    only its ``fingerprint``.
    """

    class Status(models.TextChoices):
        IN_PROGRESS = "in_progress", "in progress"
        COMPLETED = "completed", "completed"
        # A validation error's short window: no response here (it is in the
        # guard's cache); the next claim of the key takes the row over.
        RELEASED = "released", "released after a validation error"
        # The work ended its own transaction part-way, so some of it may have
        # committed: every retry is told so, and nothing runs again until an
        # operator releases the key (the admin's release action) or it expires.
        INTERRUPTED = "interrupted", "interrupted: outcome unknown"

    scope = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    operation = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices)
    token = models.CharField(max_length=32)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(help_text="When the record stops replaying.")
    locked_until = models.DateTimeField(
        null=True, blank=True, help_text="End of an in-progress claim's lease."
    )
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_headers = models.TextField(blank=True, default="")
    response_body = models.BinaryField(null=True, blank=True)
    format_version = models.PositiveSmallIntegerField(default=1)

    class Meta:
        verbose_name = "idempotency record"
        constraints = [
            models.UniqueConstraint(fields=["key", "scope"], name="idempotency_key_scope_uniq"),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idempotency_expires_idx"),
            # The admin's search and list by scope. Migration 0004 also adds
            # idempotency_lease_idx on in-progress claims' leases (the sweep).
            models.Index(fields=["scope", "id"], name="idempotency_scope_idx"),
            # A day of the admin's date drill-down, newest first, read in
            # index order (migration 0006).
            models.Index(fields=["created_at", "id"], name="idempotency_created_id_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.scope}, {self.status})"
