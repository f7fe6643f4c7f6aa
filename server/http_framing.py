"""Request framing that a proxy and this server could read differently is refused.

* :class:`FramingMiddleware` (ASGI): a request with both ``Content-Length`` and
  ``Transfer-Encoding`` is a 400 before its body is read, and the connection is closed. RFC 9112
  section 6.3 lets a server take either, so a proxy in front that frames by the other one would
  see a different request boundary: request smuggling.
* :func:`strict_h11_protocol` (uvicorn's HTTP protocol class): a chunk size that does not fit
  63 bits (``ffffffffffffffffff``) is a 400, and one larger than the body limit a 413, as soon
  as its chunk header is read (h11 takes any 20 hex digits and waits for that many bytes).
  Every error the HTTP layer answers itself (a malformed request line or header, a bad chunk)
  is sent in OpenAI's shape, ``{"error": {...}}``, instead of uvicorn's plain text, and closes
  the connection.
"""

from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import APIError, error_body

MAX_CHUNK_SIZE = 2**63 - 1  # what a 64-bit signed size holds; above: the request is malformed


class FramingMiddleware:
    """400 in OpenAI's shape, ``Connection: close``, for a request that has both
    ``Content-Length`` and ``Transfer-Encoding``; its body is never read."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope.get("headers", [])}
            if b"content-length" in names and b"transfer-encoding" in names:
                err = APIError(400, "The request has both Content-Length and Transfer-Encoding "
                                    "headers; send one of them (a proxy and this server could "
                                    "read different bodies).", code="ambiguous_framing",
                               headers={"Connection": "close"})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BoundedChunks(h11.Connection):
    """h11's connection, refusing a chunk size above ``max_chunk`` once its header is read.
    (Reads h11's current reader: h11 exposes no hook for chunk headers.)"""

    max_chunk: int = MAX_CHUNK_SIZE
    refusal: tuple[int, str, str] | None = None  # (status, message, code) of the last refusal

    def next_event(self) -> Any:
        event = super().next_event()
        size = getattr(self._reader, "_bytes_in_chunk", 0)
        if size > MAX_CHUNK_SIZE:
            self.refusal = (400, f"A chunk size of {size:x} (hex) is not a valid size.",
                            "invalid_chunk_size")
        elif size > self.max_chunk:
            self.refusal = (413, f"A chunk of {size} bytes is larger than this server accepts "
                                 f"({self.max_chunk} bytes, --max-request-body-size).",
                            "request_too_large")
        if self.refusal is not None:
            raise h11.RemoteProtocolError(self.refusal[1])
        return event


def strict_h11_protocol(max_body_size: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the checks of the module docstring, for a body limit of
    ``max_body_size`` bytes (pass it as ``uvicorn.Config(http=...)``)."""

    class StrictH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            limit = self.config.h11_max_incomplete_event_size
            conn = (_BoundedChunks(h11.SERVER) if limit is None else
                    _BoundedChunks(h11.SERVER, limit))  # as uvicorn builds its own
            conn.max_chunk = max_body_size
            self.conn = conn

        def send_400_response(self, msg: str) -> None:
            status, message, code = self.conn.refusal or (400, f"{msg.rstrip('.')}: the "
                                                          "request is not valid HTTP/1.1.",
                                                          "invalid_http_request")
            body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
            try:
                for event in (h11.Response(status_code=status, reason=_REASONS[status],
                                           headers=[(b"content-type", b"application/json"),
                                                    (b"content-length", b"%d" % len(body)),
                                                    (b"connection", b"close")]),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # a response had begun: nothing more can be said
                pass
            self.transport.close()

    return StrictH11Protocol


_REASONS = {400: b"Bad Request", 413: b"Content Too Large"}
