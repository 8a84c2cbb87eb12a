"""The example's OpenAPI schema class: drf-spectacular's, plus the idempotency
protocol (``IdempotencySchemaMixin``, first) and the API's own errors.

A project that only wants the protocol writes one line instead:
``"DEFAULT_SCHEMA_CLASS": "idempotency_app.integrations.openapi.AutoSchema"``. This one
also documents what DRF answers by itself (drf-spectacular leaves it out), so
that every status the example sends is in its schema: 401 without
credentials, 404 for an object that is not the user's, 400 for a body that
does not validate. Where both the view and the idempotency layer answer 400,
the schema offers both bodies.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema

from idempotency_app.integrations.openapi import IdempotencySchemaMixin

DETAIL = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
# {"field": ["message", ...]}, {"non_field_errors": [...]} or, for a body
# that does not parse, {"detail": "JSON parse error - ..."}.
VALIDATION_ERRORS = {
    "type": "object",
    "additionalProperties": {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]
    },
}


class DocumentedErrors(SpectacularAutoSchema):
    def _get_response_bodies(self, direction: str = "response") -> dict[str, Any]:  # type: ignore[override]
        responses: dict[str, Any] = super()._get_response_bodies(direction)  # type: ignore[arg-type]
        if direction != "response":
            return responses
        errors: dict[str, tuple[str, dict[str, Any]]] = {}
        if self.method in ("POST", "PUT", "PATCH"):
            errors["400"] = ("The body does not validate.", VALIDATION_ERRORS)
        if self.get_auth():
            errors["401"] = ("No valid credentials.", DETAIL)
        if "{" in self.path:
            errors["404"] = ("No such object among yours.", DETAIL)
        for status, (description, schema) in errors.items():
            responses.setdefault(
                status,
                {"description": description, "content": {"application/json": {"schema": schema}}},
            )
        return responses


class AutoSchema(IdempotencySchemaMixin, DocumentedErrors):
    pass
