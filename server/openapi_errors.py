"""``/openapi.json`` documents the errors the server sends: OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with a 400 for an invalid request (FastAPI
would document its own 422 ``HTTPValidationError``, which this server never sends: its
validation errors are 400s in OpenAI's shape, server/errors.py) and any other error status
(401, 404, 405, 413, 500, 503) in the same shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

ERROR_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": {
        "title": "ErrorResponse",
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"$ref": "#/components/schemas/Error"}},
    },
    "Error": {
        "title": "Error",
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "examples": ["invalid_request_error"]},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}],
                      "description": "The request parameter at fault, dotted (messages.0.content)"},
            "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    },
}
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


def openai_error_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's OpenAPI document) with every operation's 422 replaced by a 400 and
    an error ``default``, both in OpenAI's error shape; FastAPI's validation-error schemas
    removed. Modifies and returns ``schema``."""
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None or "requestBody" in op:
                responses["400"] = {"description": "Invalid request", "content": _ERROR_CONTENT}
            responses["default"] = {"description": "Error (401, 404, 413, 503, 500, ...)",
                                    "content": _ERROR_CONTENT}
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas.update(ERROR_SCHEMAS)
    return schema


def install(app: FastAPI) -> None:
    """Serve ``openai_error_responses`` of the app's schema at ``/openapi.json`` (built once,
    on first use, as FastAPI does)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openai_error_responses(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
