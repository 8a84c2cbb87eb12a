from __future__ import annotations

from django.conf import settings
from django.db import models


class Account(models.Model):
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="accounts"
    )
    name = models.CharField(max_length=100)
    balance = models.BigIntegerField(default=0, help_text="In cents.")

    def __str__(self) -> str:
        return self.name


class Charge(models.Model):
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="charges")
    amount = models.PositiveBigIntegerField(help_text="In cents.")
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"Charge {self.pk} of {self.amount}"


class Refund(models.Model):
    charge = models.ForeignKey(Charge, on_delete=models.PROTECT, related_name="refunds")
    amount = models.PositiveBigIntegerField(help_text="In cents.")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"Refund {self.pk} of {self.amount}"


class ProviderPayment(models.Model):
    """Money a payment provider reports as received, credited once per event."""

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="provider_payments")
    provider = models.CharField(max_length=50)
    event_id = models.CharField(max_length=255, help_text="The provider's event id.")
    amount = models.PositiveBigIntegerField(help_text="In cents.")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.provider} event {self.event_id}"


class Receipt(models.Model):
    """Sent by a task once per credited provider payment (see payments/tasks.py).
    One per payment: a second execution would fail on the unique constraint."""

    payment = models.OneToOneField(
        ProviderPayment, on_delete=models.PROTECT, related_name="receipt"
    )
    sent_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"Receipt for {self.payment}"
