"""Pure-ASGI middleware: request ids, the API key, one log line per request, a last-resort
500 that never shows a traceback, and the request body size limit (413).

Pure ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses pass through
untouched and a client disconnect still reaches the endpoint.
"""

from __future__ import annotations

import logging
import re
import time
import traceback
import uuid
from typing import Any

from server.auth import is_protected, key_matches, query_key_matches
from server.errors import APIError, internal_error

logger = logging.getLogger("kvserve.server")

_SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Polled by load balancers and Prometheus every few seconds: not worth an INFO line each.
_QUIET_PATHS = frozenset({"/health", "/metrics"})


# A failure's traceback in the log, bounded: an attacker must not size the log line (a
# RecursionError from a deeply nested value is a thousand frames).
TRACEBACK_FRAMES = 20
TRACEBACK_CHARS = 8000


def bounded_traceback(exc: BaseException) -> str:
    """The last ``TRACEBACK_FRAMES`` frames of ``exc``'s traceback, at most ``TRACEBACK_CHARS``
    characters (the end, where the error is)."""
    text = "".join(traceback.format_exception(exc, limit=-TRACEBACK_FRAMES, chain=False))
    return text if len(text) <= TRACEBACK_CHARS else "..." + text[-TRACEBACK_CHARS:]


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it is a safe token, else a fresh one."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            candidate = value.decode("latin-1").strip()
            if _SAFE_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


class RequestContextMiddleware:
    def __init__(self, app: Any, api_key: str | None = None, log_requests: bool = True) -> None:
        self.app = app
        self.api_key = api_key
        self.log_requests = log_requests

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        rid = request_id_from(headers)
        scope.setdefault("state", {})["request_id"] = rid
        path, method = scope.get("path", ""), scope.get("method", "")
        start = time.perf_counter()
        status: list[int] = []

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            if self.api_key and is_protected(path) and \
                    not key_matches(_header(headers, b"authorization"), self.api_key) and \
                    not query_key_matches(path, scope.get("query_string", b""), self.api_key):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                                    "<key>'.", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            logger.error("request_id=%s %s %s failed: %s", rid, method, path,
                         bounded_traceback(exc))
            if not status:  # nothing sent yet: answer in OpenAI's shape, without the traceback
                await internal_error(rid).response()(scope, receive, send_with_id)
        finally:
            if self.log_requests and path not in _QUIET_PATHS:
                code = status[0] if status else 499  # 499: the client went away first
                logger.info("%s %s %d %.1fms request_id=%s", method, path, code,
                            (time.perf_counter() - start) * 1000, rid)


class _BodyTooLargeError(Exception):
    pass


class BodySizeLimitMiddleware:
    """413 in OpenAI's shape for a body above ``max_body_size`` bytes: refused from its
    ``Content-Length`` before a byte is read, and counted while reading (a chunked body has no
    length), so that a huge body is never buffered or parsed. The 413 closes the connection:
    the rest of the body is not read."""

    def __init__(self, app: Any, max_body_size: int) -> None:
        self.app = app
        self.max_body_size = max_body_size

    def _error(self) -> APIError:
        return APIError(413, f"The request body is larger than this server accepts "
                             f"({self.max_body_size} bytes, --max-request-body-size).",
                        code="request_too_large", headers={"Connection": "close"})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_size
        declared = _header(scope.get("headers", []), b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await self._error().response()(scope, receive, send)
            return
        received = 0
        too_large = started = False

        async def counting_receive() -> dict:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    raise _BodyTooLargeError
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if not too_large:  # the app's own answer to the failed read gives way to the 413
                started = True
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await self._error().response()(scope, receive, send)
