from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand

from example_project.payments.models import Account


class Command(BaseCommand):
    help = "Create the demo users alice/alice and bob/bob, each with an account."

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("alice", "bob"):
            user, created = User.objects.get_or_create(
                username=name,
                defaults={"is_staff": name == "alice", "is_superuser": name == "alice"},
            )
            if created:
                user.set_password(name)
                user.save()
            account, _ = Account.objects.get_or_create(
                owner=user, name=f"{name}'s account", defaults={"balance": 100_000}
            )
            if options["verbosity"] >= 1:
                self.stdout.write(f"{name}/{name}: account {account.pk}")
