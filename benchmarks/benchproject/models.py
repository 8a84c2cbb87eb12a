from __future__ import annotations

from django.db import models


class Charge(models.Model):
    label = models.CharField(max_length=100)
    amount = models.IntegerField()

    def __str__(self) -> str:
        return f"{self.label} {self.amount}"


class LedgerEntry(models.Model):
    """The second write of the write view, in the same transaction."""

    charge = models.ForeignKey(Charge, on_delete=models.CASCADE)
    amount = models.IntegerField()

    def __str__(self) -> str:
        return f"{self.charge_id} {self.amount}"
