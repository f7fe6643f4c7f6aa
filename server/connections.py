"""The HTTP connection layer: uvicorn's h11 protocol with the limits uvicorn lacks.

uvicorn never times out a connection that has not finished its request, and counts open
connections against ``--limit-concurrency``, so idle or slowloris sockets could make it refuse
everything. :class:`GuardedH11Protocol` (the ``http`` protocol class given to uvicorn, see
:func:`protocol_class`) adds, per connection, ``header_timeout`` and ``body_timeout`` (a
connection that sent nothing is closed silently, one that sent part of a request gets a 408 in
OpenAI's error shape) and ``max_connections_per_client`` (the next one gets a 503
``too_many_connections``); the limits are spelled out on the class.

It also hands each request a :class:`server.write_progress.WriteProgress` for its connection
(``scope["extensions"]["kvserve.write_progress"]``), with which a streaming response times a
client that stopped reading. The server-wide ``--limit-concurrency`` is applied per request by
:class:`server.overload.OverloadMiddleware` (``/health`` stays answerable), from the count of
open connections kept here by :class:`ConnectionTracker`."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import APIError
from server.sse import dumps
from server.write_progress import WriteProgress

logger = logging.getLogger("kvserve.server")

WRITE_PROGRESS = "kvserve.write_progress"


class ConnectionTracker:
    """What every connection of one server shares: the open connections and how many each
    client address holds. ``header_timeout`` / ``body_timeout``: seconds, 0 = none;
    ``max_connections_per_client``: None = no cap. Event loop only."""

    def __init__(self, header_timeout: float = 10.0, body_timeout: float = 60.0,
                 max_connections_per_client: int | None = None) -> None:
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections_per_client = max_connections_per_client
        self.per_client: Counter[str] = Counter()
        self.open: set[GuardedH11Protocol] = set()

    @property
    def num_open(self) -> int:
        return len(self.open)

    def admit(self, conn: GuardedH11Protocol, address: str | None) -> bool:
        cap = self.max_connections_per_client
        if cap is not None and address is not None and self.per_client[address] >= cap:
            return False
        self.open.add(conn)
        if address is not None:
            self.per_client[address] += 1
        return True

    def release(self, conn: GuardedH11Protocol, address: str | None) -> None:
        if conn not in self.open:
            return
        self.open.discard(conn)
        if address is not None:
            self.per_client[address] -= 1
            if self.per_client[address] <= 0:
                del self.per_client[address]


def raw_error(error: APIError) -> bytes:
    """A whole HTTP/1.1 response carrying ``error`` in OpenAI's shape, closing the connection:
    written straight to the transport where no request (or no ASGI response) exists."""
    body = dumps(error.body()).encode()
    head = [f"HTTP/1.1 {error.status} {_REASONS.get(error.status, '')}",
            "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in (error.headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with per-connection limits. ``tracker`` is set on the subclass
    :func:`protocol_class` makes.

    - ``header_timeout``: seconds from the connection's start (or the end of the previous
      response on a kept-alive one) to the end of the request's headers. A connection that sent
      nothing is closed silently (as a keep-alive timeout closes it); one that sent part of a
      request gets a 408 in OpenAI's error shape, then is closed.
    - ``body_timeout``: seconds from the end of the headers to the end of the body; then 408 and
      close, and the endpoint sees the client gone.
    - ``max_connections_per_client``: open connections one client address may hold; the next
      one gets a 503 (``too_many_connections``) and is closed at once.
    """

    tracker: ConnectionTracker

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: Any = None
        self._phase: str | None = None
        self._scope: Any = None
        self._address = self.client[0] if self.client else None
        self.write_progress = WriteProgress(transport)
        if not self.tracker.admit(self, self._address):
            cap = self.tracker.max_connections_per_client
            logger.warning("client %s holds %d connections (--max-connections-per-client): "
                           "refused one", self._address, cap)
            self._refuse(APIError(503, f"Too many connections from your address (at most "
                                       f"{cap}, --max-connections-per-client); reuse or close "
                                       f"some.", code="too_many_connections",
                                  headers={"Retry-After": "1"}))
            return
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_timer(None)
        self.tracker.release(self, self._address)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.scope is not None and self.scope is not self._scope:  # a new request
            self._scope = self.scope
            self.scope["extensions"] = {**(self.scope.get("extensions") or {}),  # type: ignore
                                        WRITE_PROGRESS: self.write_progress}
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    # ---- timers -------------------------------------------------------------------------

    def _watch(self) -> None:
        """(Re)arm the timer of the phase the request is in: its headers, its body, or none."""
        if self.transport.is_closing():
            return self._set_timer(None)
        state = self.conn.their_state
        phase = ("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY
                 else None)
        if phase == self._phase:
            return
        self._phase = phase
        timeout = {"headers": self.tracker.header_timeout,
                   "body": self.tracker.body_timeout}.get(phase or "", 0)
        self._set_timer(self.loop.call_later(timeout, self._expired, phase) if timeout
                        else None)

    def _set_timer(self, timer: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = timer

    def _expired(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing() or phase != self._phase:
            return
        if phase == "headers" and not self.conn.trailing_data[0]:
            self.transport.close()  # idle: nothing of a request came (a keep-alive timeout)
            return
        timeout = self.tracker.header_timeout if phase == "headers" else \
            self.tracker.body_timeout
        flag = "--header-timeout" if phase == "headers" else "--body-timeout"
        logger.info("client %s: the request's %s did not arrive within %gs (%s): closed",
                    self._address, phase, timeout, flag)
        cycle = self.cycle
        if phase == "body" and cycle is not None:
            if cycle.response_started:
                self.transport.close()
                return
            cycle.disconnected = True  # the endpoint's own answer (if any) is not sent
            cycle.message_event.set()  # an endpoint waiting for the body sees the client gone
        self._refuse(APIError(408, f"The request's {phase} did not arrive within {timeout:g} "
                                   f"seconds ({flag}).", code="request_timeout"))

    def _refuse(self, error: APIError) -> None:
        self.transport.write(raw_error(error))
        self.transport.close()


class _JsonErrorsH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, its own 400 (bytes that are not HTTP) in OpenAI's shape."""

    def send_400_response(self, msg: str) -> None:
        self.transport.write(raw_error(APIError(400, f"{msg} (not an HTTP/1.1 request)",
                                                code="invalid_http_request")))
        self.transport.close()


def protocol_class(tracker: ConnectionTracker,
                   base: type[H11Protocol] = H11Protocol) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``), bound to
    ``tracker``: this module's guards over ``base`` (another subclass of uvicorn's h11
    protocol, e.g. one with framing checks of its own; the plain one gets OpenAI-shaped 400s)."""
    if base is H11Protocol:
        base = _JsonErrorsH11Protocol
    return type("KVServeH11Protocol", (GuardedH11Protocol, base), {"tracker": tracker})
