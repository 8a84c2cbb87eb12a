"""``IdempotentMixin``: covers a view's unsafe methods without touching each handler."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.views import View
from rest_framework.request import Request
from rest_framework.views import APIView

from idempotency_app.conf import conf
from idempotency_app.http import async_handling, handling
from idempotency_app.http.options import Options, declare


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

    _idempotency_options = Options()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Build and check the options when the view class is defined: a
        mistake fails at import, and no request pays for it."""
        super().__init_subclass__(**kwargs)
        if issubclass(cls, View) and not issubclass(cls, APIView):
            raise ImproperlyConfigured(
                f"IdempotentMixin on {cls.__qualname__}, a Django view without DRF: the mixin "
                "runs after DRF's authentication and permission checks, which this view does "
                "not have, so it would never cover a request. Base the view on DRF's APIView "
                "(adrf's, for async handlers), or use service.once() inside the view."
            )
        mro = cls.__mro__
        if APIView in mro and mro.index(APIView) < mro.index(IdempotentMixin):
            raise ImproperlyConfigured(
                f"IdempotentMixin comes after DRF's APIView in {cls.__qualname__}'s bases: "
                "APIView.initial() runs instead of the mixin's, so no request would be covered. "
                f"List the mixin first: class {cls.__name__}(IdempotentMixin, <your DRF base>)."
            )
        cls._idempotency_options = declare(
            cls.__module__,
            cls.__qualname__,
            Options(
                ttl=cls.idempotency_ttl,
                lease=cls.idempotency_lease,
                wait=cls.idempotency_wait,
                required=cls.idempotency_required,
                scope=cls.idempotency_scope,
                fingerprint=cls.idempotency_fingerprint,
                methods=cls.idempotency_methods,
            ),
        )

    def get_idempotency_options(self) -> Options:
        return self._idempotency_options

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
        if iscoroutinefunction(handler):  # an adrf async view
            setattr(self, method, async_handling.covered(self, handler, options))  # type: ignore[arg-type]
            return

        @functools.wraps(handler)
        def idempotent_handler(request: Request, *args: Any, **kwargs: Any) -> Any:
            call = functools.partial(handler, request, *args, **kwargs)
            return handling.handle(self, request, call, options)  # type: ignore[arg-type]

        setattr(self, method, idempotent_handler)
