"""``IdempotentMixin``: covers a view's unsafe methods without touching each handler."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from rest_framework.request import Request

from idempotency_app import drf
from idempotency_app.conf import conf


class IdempotentMixin:
    """Put it before the DRF base class: ``class V(IdempotentMixin, APIView)``.

    Covers ``IDEMPOTENCY["METHODS"]`` (POST and PATCH by default) unless
    ``idempotency_methods`` says otherwise.
    """

    idempotency_methods: Iterable[str] | None = None
    idempotency_required: bool = False
    idempotency_ttl: float | None = None
    idempotency_lease: float | None = None
    idempotency_wait: float | None = None
    idempotency_scope: str | Callable[[Any], str | None] | None = None
    idempotency_fingerprint: str | Callable[[Any], str] | None = None

    def get_idempotency_options(self) -> drf.Options:
        return drf.Options(
            ttl=self.idempotency_ttl,
            lease=self.idempotency_lease,
            wait=self.idempotency_wait,
            required=self.idempotency_required,
            scope=self.idempotency_scope,
            fingerprint=self.idempotency_fingerprint,
            methods=self.idempotency_methods,
        )

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        """After DRF's own checks, wrap this request's handler.

        The view instance lives for one request, so shadowing the handler
        attribute on it affects that request only.
        """
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        method = (request.method or "").lower()
        handler = getattr(self, method, None)
        options = self.get_idempotency_options()
        if handler is None or not options.covers(method, conf.METHODS):
            return
        if hasattr(handler, "idempotency_options"):
            return  # @idempotent on the handler itself is more specific and wins

        @functools.wraps(handler)
        def idempotent_handler(request: Request, *args: Any, **kwargs: Any) -> Any:
            return drf.handle(self, request, lambda: handler(request, *args, **kwargs), options)  # type: ignore[arg-type]

        setattr(self, method, idempotent_handler)
