"""Anthropic's error shape on the Messages API's paths, and its ``x-api-key`` header.

Every failure on ``/v1/messages`` and below, whoever raised it (validation, the routes, the API
key check, the body size limit, ``--limit-concurrency``, the last-resort 500), is written as
``{"type": "error", "error": {"type", "message"}, "request_id"}``: ``AnthropicMiddleware`` sits
outside the server's own middleware and rewrites the OpenAI-shaped error bodies they send. The
status picks the type: 400 ``invalid_request_error``, 401 ``authentication_error``, 403
``permission_error``, 404 ``not_found_error``, 413 ``request_too_large``, 429
``rate_limit_error``, 500 ``api_error``, and 503 (queue full, overloaded, shutting down) becomes
Anthropic's 529 ``overloaded_error``, ``Retry-After`` kept.

With ``--api-key``, these paths also take the key as ``x-api-key: <key>`` (what Anthropic's
clients send), besides ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import json
from typing import Any

from server.auth import key_matches

PATH = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 529: "overloaded_error"}
_STATUS = {503: 529}  # Anthropic's "overloaded" status


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_status(status: int) -> int:
    return _STATUS.get(status, status)


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error body for a failure with HTTP ``status`` (the server's own status:
    503 is reported as ``overloaded_error``)."""
    status = error_status(status)
    kind = _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def _message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if status == 401:
        return ("Incorrect or missing API key: send 'x-api-key: <key>' or 'Authorization: "
                "Bearer <key>'.")
    return message if isinstance(message, str) else f"HTTP {status}"


class AnthropicMiddleware:
    """Pure ASGI, around the server's own middleware: on the Messages API's paths, accepts
    ``x-api-key`` and rewrites every JSON error response into Anthropic's shape (see the
    module's docstring). Other paths pass through untouched."""

    def __init__(self, app: Any, api_key: str | None = None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_anthropic_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if self.api_key:
            scope = self._with_key(scope)
        held: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def rewriting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                if message["status"] >= 400 and _is_json(message.get("headers", [])):
                    held["start"] = message
                    return
            elif message["type"] == "http.response.body" and "start" in held:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._send_error(held["start"], b"".join(chunks), send)
                return
            await send(message)

        await self.app(scope, receive, rewriting_send)

    def _with_key(self, scope: dict) -> dict:
        """``scope`` with ``Authorization: Bearer <x-api-key>`` when its x-api-key is the key
        (the server's own check then passes it)."""
        headers = scope.get("headers", [])
        key = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-api-key"), None)
        assert self.api_key is not None
        if key is None or not key_matches(f"Bearer {key}", self.api_key):
            return scope
        kept = [(k, v) for k, v in headers if k.lower() != b"authorization"]
        return {**scope, "headers": [*kept, (b"authorization", f"Bearer {key}".encode())]}

    @staticmethod
    async def _send_error(start: dict, body: bytes, send: Any) -> None:
        status = start["status"]
        headers = [(k, v) for k, v in start.get("headers", [])
                   if k.lower() != b"content-length"]
        rid = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"),
                   None)
        out = json.dumps(error_body(status, _message(status, body), rid)).encode()
        headers.append((b"content-length", str(len(out)).encode()))
        await send({**start, "status": error_status(status), "headers": headers})
        await send({"type": "http.response.body", "body": out, "more_body": False})


ERROR_SCHEMA: dict[str, Any] = {
    "title": "AnthropicErrorResponse", "type": "object", "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string", "examples": ["invalid_request_error"]},
            "message": {"type": "string"}}},
        "request_id": {"type": "string"}}}


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """The app's OpenAPI ``schema`` with the Messages API's error responses in Anthropic's
    shape (the other routes' are OpenAI's: server/openapi_errors.py)."""
    ref = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    for path, ops in schema.get("paths", {}).items():
        if not is_anthropic_path(path):
            continue
        for op in ops.values():
            for status, response in op.get("responses", {}).items():
                if status == "default" or status.startswith(("4", "5")):
                    response["content"] = {"application/json": {"schema": ref}}
    schema.setdefault("components", {}).setdefault("schemas", {})[
        "AnthropicErrorResponse"] = ERROR_SCHEMA
    return schema


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json")
               for k, v in headers)
