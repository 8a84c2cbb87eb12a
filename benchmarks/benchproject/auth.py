"""Token authentication against a table in memory.

Real authentication (a missing or unknown token is a 401, and
``request.user`` is a principal with a pk, named by ``scope`` below) at the
cost of one dictionary lookup: the floor stays the floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

TOKENS: dict[str, int] = {"bench-token-1": 1, "bench-token-2": 2}


@dataclass(frozen=True)
class Principal:
    pk: int
    is_authenticated: bool = True
    is_anonymous: bool = False


class TokenTableAuthentication(BaseAuthentication):
    keyword = b"Token"

    def authenticate(self, request: Request) -> tuple[Any, str] | None:
        parts = get_authorization_header(request).split()
        if len(parts) != 2 or parts[0] != self.keyword:
            return None
        token = parts[1].decode("latin-1")
        pk = TOKENS.get(token)
        if pk is None:
            return None
        return Principal(pk), token

    def authenticate_header(self, request: Request) -> str:
        return "Token"


def scope(request: Any) -> str:
    """The idempotency scope of a bench principal (not a Django model, so the
    default scope refuses it): its pk, as the default names a user."""
    return f"user:{request.user.pk}"
