"""OpenAPI for drf-spectacular: every idempotent operation documents the protocol.

One line of settings, in place of drf-spectacular's own schema class::

    REST_FRAMEWORK = {"DEFAULT_SCHEMA_CLASS": "idempotency_app.integrations.openapi.AutoSchema"}

Each method an ``@idempotent`` handler or an ``IdempotentMixin`` view covers
then documents, with no per-view work:

- the ``Idempotency-Key`` request header (required when the view says
  ``required=True``) and its format;
- the answers the layer adds (400, 406, 409, 422, 500 ``request_rolled_back``
  and ``request_outcome_unknown``, 503), with their codes and bodies in the shape ``ERROR_FORMAT`` gives them;
- the headers it adds: ``Idempotent-Replayed`` and ``Idempotency-Expires`` on
  the view's own responses, ``Retry-After`` on 409 and 503.

A project with a schema class of its own (drf-standardized-errors' one, say)
puts ``IdempotencySchemaMixin`` first::

    class AutoSchema(IdempotencySchemaMixin, drf_standardized_errors.openapi.AutoSchema):
        pass

The view's own declarations win: a header parameter declared with
``@extend_schema`` replaces ours, and a status the view already documents
keeps its body, ours joining it as an alternative (``anyOf``).
"""

from __future__ import annotations

import inspect
from typing import Any

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import OpenApiExample, OpenApiParameter
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.viewsets import ViewSetMixin

from idempotency_app.conf import SAFE_METHODS, conf
from idempotency_app.decorators import DECORATOR_METHODS
from idempotency_app.http import problems
from idempotency_app.http.handling import RETRYABLE_STATUSES, TRANSIENT_CLIENT_ERRORS
from idempotency_app.http.keys import MAX_KEY_LENGTH
from idempotency_app.http.options import Options, options_of_function_view
from idempotency_app.http.replay import BODY_OMITTED_HEADER, EXPIRES_HEADER, REPLAYED_HEADER

# 1 to 255 printable ASCII characters, neither starting nor ending with a
# space or a double quote: every value matching it is accepted as it is.
# (A quoted Structured-Field string, "abc", is accepted too, and unquoted.)
KEY_PATTERN = rf"^[!#-~](?:[ -~]{{0,{MAX_KEY_LENGTH - 2}}}[!#-~])?$"
KEY_EXAMPLE = "3f0e6c1e-6b0e-4d7b-9c52-2f5f0c1f0a11"

# status -> (component name, codes, what the client should do)
ERRORS: dict[int, tuple[str, tuple[str, ...], str]] = {
    400: (
        "IdempotencyKeyError",
        ("idempotency_key_missing", "idempotency_key_invalid", "idempotency_scope_missing"),
        "The Idempotency-Key header is missing where the operation requires one "
        "(`idempotency_key_missing`), malformed (`idempotency_key_invalid`), or sent by an "
        "anonymous client (`idempotency_scope_missing`). Nothing ran: fix the request and send it "
        "again.",
    ),
    406: (
        "IdempotencyReplayNotAcceptable",
        ("idempotency_replay_not_acceptable",),
        "The response stored for this key has a media type this request's `Accept` does not "
        "allow (`idempotency_replay_not_acceptable`). Nothing ran again: retry with an `Accept` "
        "that allows it.",
    ),
    409: (
        "IdempotencyRequestInProgress",
        ("request_in_progress",),
        "A request with this key is still running (`request_in_progress`). Retry with the same "
        "key after `Retry-After` seconds to get its result.",
    ),
    422: (
        "IdempotencyKeyReused",
        ("idempotency_key_reused",),
        "This key was already used for a different request (`idempotency_key_reused`). Nothing "
        "ran: send a new request with a new key.",
    ),
    500: (
        "IdempotencyRequestRolledBack",
        ("request_rolled_back", "request_outcome_unknown"),
        "The operation's work was rolled back, so nothing was done (`request_rolled_back`): retry "
        "with the same key, it runs again. Or it was interrupted after part of it may have been "
        "saved (`request_outcome_unknown`): every retry with this key gets this answer, so check "
        "what was done before sending the request again with a new key.",
    ),
    503: (
        "IdempotencyStoreUnavailable",
        ("idempotency_store_unavailable",),
        "The key or the outcome could not be recorded (`idempotency_store_unavailable`). Retry "
        "with the same key after `Retry-After` seconds: you get the result if the work was done, "
        "and it runs once if it was not.",
    ),
}
RETRY_AFTER_STATUSES = frozenset({409, 503})
HEADERS: dict[str, tuple[str, dict[str, Any], str]] = {
    REPLAYED_HEADER: (
        "IdempotentReplayed",
        {"type": "string", "enum": ["true"]},
        "Present on a replay: this response was stored by an earlier request with the same "
        "key, and nothing ran again.",
    ),
    EXPIRES_HEADER: (
        "IdempotencyExpires",
        {"type": "string"},
        "An HTTP date: until then, a retry with the same key replays this response.",
    ),
    BODY_OMITTED_HEADER: (
        "IdempotentBodyOmitted",
        {"type": "string", "enum": ["true"]},
        "Present on a replay whose body was too large (or streamed) to store: the body is "
        "empty; fetch the resource to read it.",
    ),
}
RETRY_AFTER = (
    "Retry-After",
    {"type": "integer", "minimum": 0},
    "Seconds to wait before retrying with the same key.",
)


def covering_options(view: Any, method: str) -> Options | None:
    """The options under which ``view`` runs ``method`` idempotently, or
    None when it does not: the handler's ``@idempotent`` first (it wins at
    run time too), then an ``IdempotentMixin`` view's own."""
    method = method.upper()
    if not conf.ENABLED or method in SAFE_METHODS:
        return None
    action = getattr(view, "action", None)
    if isinstance(view, ViewSetMixin) and action:
        handler = getattr(view, action, None)
    else:
        handler = getattr(view, method.lower(), None)
    declared = declared_options(view, handler)
    if declared is not None:
        return declared if declared.covers(method, DECORATOR_METHODS) else None
    get_options = getattr(view, "get_idempotency_options", None)
    if handler is not None and callable(get_options):
        options = get_options()
        if isinstance(options, Options) and options.covers(method, conf.METHODS):
            return options
    return None


def declared_options(view: Any, handler: Any) -> Options | None:
    """``@idempotent``'s options on ``handler``: on the handler itself (or a
    wrapper that keeps ``__wrapped__``), or, for a function view, declared
    for the function that DRF's ``@api_view`` made the view's class of."""
    if handler is None:
        return None
    function = inspect.unwrap(getattr(handler, "__func__", handler))
    for candidate in (handler, function):
        options = getattr(candidate, "idempotency_options", None)
        if isinstance(options, Options):
            return options
    return options_of_function_view(type(view))


class IdempotencySchemaMixin:
    """Adds the protocol to drf-spectacular's ``AutoSchema`` (or a subclass)."""

    view: Any
    method: str
    registry: Any

    def idempotency_options(self) -> Options | None:
        return covering_options(self.view, self.method)

    def get_override_parameters(self) -> list[Any]:
        declared: list[Any] = list(super().get_override_parameters())  # type: ignore[misc]
        options = self.idempotency_options()
        if options is None:
            return declared
        return [self._key_parameter(options), *declared]  # the view's own come later and win

    def _get_response_bodies(self, direction: str = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)  # type: ignore[misc]
        if direction != "response" or self.idempotency_options() is None:
            return responses
        for status, response in responses.items():
            self._add_replay_headers(status, response)
        for code in sorted(ERRORS):
            ours = self._error_response(code)
            if str(code) in responses:
                _merge(responses[str(code)], ours)
            else:
                responses[str(code)] = ours
        return responses

    def _key_parameter(self, options: Options) -> OpenApiParameter:
        required = "Required" if options.required else "Optional"
        return OpenApiParameter(
            name=conf.HEADER,
            type={
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_KEY_LENGTH,
                "pattern": KEY_PATTERN,
            },
            location=OpenApiParameter.HEADER,
            required=options.required,
            description=(
                f"{required}. A unique value per intended operation (a UUID v4), sent again "
                "unchanged on every retry of it: the first request runs, retries get its "
                "stored response, and a concurrent duplicate never runs twice. 1 to 255 "
                "printable ASCII characters; surrounding spaces are trimmed, and a quoted "
                'Structured-Field string ("abc") is unquoted.'
                + ("" if options.required else " Without it, the request runs unprotected.")
            ),
            examples=[OpenApiExample("uuid", value=KEY_EXAMPLE)],
        )

    def _add_replay_headers(self, status: str, response: dict[str, Any]) -> None:
        """The view's own responses are stored, and replayed, unless a retry
        may change them (5xx, 408, 409, 425, 429); a 400 or 415 is replayed
        for a few seconds from the retry-storm guard, never stored."""
        if not status.isdigit():
            return
        code = int(status)
        if code >= 500 or code in RETRYABLE_STATUSES:
            return
        names = [REPLAYED_HEADER]
        if code not in TRANSIENT_CLIENT_ERRORS:
            names += [EXPIRES_HEADER, BODY_OMITTED_HEADER]
        headers = response.setdefault("headers", {})
        for name in names:
            headers.setdefault(name, self._header(name))

    def _header(self, name: str) -> dict[str, Any]:
        component_name, schema, description = HEADERS[name]
        component = ResolvedComponent(  # type: ignore[no-untyped-call]
            name=component_name,
            type=ResolvedComponent.HEADER,
            schema={"schema": schema, "description": description},
            object=f"idempotency_app.header.{component_name}",
        )
        self.registry.register_on_missing(component)
        return component.ref

    def _error_response(self, status: int) -> dict[str, Any]:
        name, codes, description = ERRORS[status]
        schema, suffix = self._error_schema(status, codes)
        component = ResolvedComponent(  # type: ignore[no-untyped-call]
            name=f"{name}{suffix}",
            type=ResolvedComponent.SCHEMA,
            schema=schema,
            object=f"idempotency_app.error.{name}{suffix}",
        )
        self.registry.register_on_missing(component)
        if conf.ERROR_FORMAT == "problem":
            media_types = [problems.MEDIA_TYPE]
        else:
            media_types = list(self.map_renderers("media_type")) or ["application/json"]  # type: ignore[attr-defined]
        response: dict[str, Any] = {
            "description": description,
            "content": {media_type: {"schema": component.ref} for media_type in media_types},
        }
        if status in RETRY_AFTER_STATUSES:
            # Inline: a reference could not say that the header is always sent here.
            name, schema, header_description = RETRY_AFTER
            response["headers"] = {
                name: {"schema": schema, "description": header_description, "required": True}
            }
        return response

    def _error_schema(self, status: int, codes: tuple[str, ...]) -> tuple[dict[str, Any], str]:
        """The body the client gets, by ``ERROR_FORMAT`` (and, for
        ``"handler"``, by the view's exception handler)."""
        code = {"type": "string", "enum": list(codes)}
        if conf.ERROR_FORMAT == "problem":
            return {
                "type": "object",
                "description": "RFC 9457 problem details.",
                "properties": {
                    "type": {
                        "type": "string",
                        "enum": [problems.type_uri(c) for c in codes],
                        "description": "Identifies the problem; one per code.",
                    },
                    "title": {"type": "string"},
                    "status": {"type": "integer", "enum": [status]},
                    "detail": {"type": "string", "description": "What to do next."},
                    "code": code,
                },
                "required": ["type", "title", "status", "detail", "code"],
            }, "Problem"
        if conf.ERROR_FORMAT == "handler":
            handler = self.view.get_exception_handler()
            if handler is drf_exception_handler:
                return _object({"detail": {"type": "string"}}), "Detail"
            if problems.is_standardized_errors(handler):
                error_type = "server_error" if status >= 500 else "client_error"
                error = _object(
                    {"code": code, "detail": {"type": "string"}, "attr": {"nullable": True}}
                )
                return _object(
                    {
                        "type": {"type": "string", "enum": [error_type]},
                        "errors": {"type": "array", "items": error, "minItems": 1, "maxItems": 1},
                    }
                ), "StandardizedError"
            return {
                "type": "object",
                "description": "Shaped by the project's exception handler.",
            }, "HandlerError"
        return _object(
            {"detail": {"type": "string", "description": "What to do next."}, "code": code}
        ), ""


class AutoSchema(IdempotencySchemaMixin, SpectacularAutoSchema):
    """drf-spectacular's ``AutoSchema``, documenting the idempotency protocol."""


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _merge(existing: dict[str, Any], ours: dict[str, Any]) -> None:
    """A status the view documents already: its body and ours are both possible."""
    content = existing.setdefault("content", {})
    for media_type, entry in ours["content"].items():
        if media_type in content and "schema" in content[media_type]:
            theirs = content[media_type]["schema"]
            if theirs != entry["schema"]:
                content[media_type]["schema"] = {"anyOf": [theirs, entry["schema"]]}
        else:
            content[media_type] = entry
    for name, header in ours.get("headers", {}).items():
        existing.setdefault("headers", {}).setdefault(name, {**header, "required": False})
    existing["description"] = " ".join(
        part for part in (existing.get("description"), ours["description"]) if part
    )
