"""DRF views under the lifecycle: what identifies a request (``keys``), the
bridge that runs a handler under a claim (``handling``, and
``async_handling`` for adrf), the replay of a stored response (``replay``)
and how the library's errors are shaped (``problems``). The decorator and
the mixin that integrators use are ``idempotency_app.decorators`` and
``idempotency_app.mixins``."""
