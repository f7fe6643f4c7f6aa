"""``--limit-concurrency``, applied per request with ``/health`` (and ``/metrics``) exempt.

uvicorn's own limit counted every open connection, idle ones included, and above it answered
every request, ``/health`` included, with a plain-text 503: a load balancer then pulled the
server. Here the same limit (open connections, requests in flight) refuses work requests only,
with a 503 in OpenAI's shape (``code: "server_overloaded"``, ``Retry-After``, and the connection
closed after it), while ``/health`` and ``/metrics`` are always answered. Idle and slow
connections are closed by server/connections.py's timeouts, so the limit is reached by
requests, not by sockets that send nothing.
"""

from __future__ import annotations

from typing import Any

from server.connections import ConnectionTracker
from server.errors import APIError

ALWAYS_ANSWERED = frozenset({"/health", "/metrics"})


class OverloadMiddleware:
    """503 for a request other than :data:`ALWAYS_ANSWERED` when more than ``limit``
    connections are open (per ``tracker``; none when the server runs without
    server/connections.py) or ``limit`` requests are already in flight. ``limit`` None: no
    limit."""

    def __init__(self, app: Any, limit: int | None, tracker: ConnectionTracker | None) -> None:
        self.app = app
        self.limit = limit
        self.tracker = tracker
        self.in_flight = 0

    def _overloaded(self) -> bool:
        assert self.limit is not None
        return self.in_flight >= self.limit or (
            self.tracker is not None and self.tracker.num_open > self.limit)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.limit is None or \
                scope.get("path") in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        if self._overloaded():
            err = APIError(503, f"The server is at its limit of {self.limit} connections and "
                                f"requests in flight (--limit-concurrency); retry later.",
                           code="server_overloaded",
                           headers={"Retry-After": "1", "Connection": "close"})
            await err.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
