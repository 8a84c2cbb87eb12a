from __future__ import annotations

from django.db import models


class Charge(models.Model):
    """A side effect the tests count: one row per execution."""

    label = models.CharField(max_length=100)
    amount = models.IntegerField(default=0)


class LedgerEntry(models.Model):
    """A second write, so a partial execution would show as a lone row."""

    charge = models.ForeignKey(Charge, on_delete=models.CASCADE)
    amount = models.IntegerField()


class Tag(models.Model):
    """Unique, for the "already exists, fine" pattern."""

    name = models.CharField(max_length=100, unique=True)


class AuditEntry(models.Model):
    """Written to another database by the views that must be refused."""

    note = models.CharField(max_length=100)
