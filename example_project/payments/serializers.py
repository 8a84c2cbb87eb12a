from __future__ import annotations

from typing import Any

from rest_framework import serializers

from example_project.payments.models import Account, Charge, Refund


class AccountSerializer(serializers.ModelSerializer[Account]):
    class Meta:
        model = Account
        fields = ["id", "name", "balance"]
        read_only_fields = ["balance"]


class ChargeSerializer(serializers.ModelSerializer[Charge]):
    class Meta:
        model = Charge
        fields = ["id", "account", "amount", "description", "created_at"]
        read_only_fields = ["account", "created_at"]
        # In the schema too: a charge of 0 cents is refused.
        extra_kwargs = {"amount": {"min_value": 1}}


class RefundSerializer(serializers.ModelSerializer[Refund]):
    class Meta:
        model = Refund
        fields = ["id", "charge", "amount", "created_at"]
        read_only_fields = ["charge", "created_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        charge: Charge = self.context["charge"]
        refunded = sum(r.amount for r in charge.refunds.all())
        if attrs["amount"] > charge.amount - refunded:
            raise serializers.ValidationError({"amount": "Exceeds what is left to refund."})
        return attrs
