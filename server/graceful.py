"""The uvicorn server that ``kvserve serve`` runs: its drain on SIGTERM/SIGINT and its watch
on the engine.

:class:`GracefulServer` drains instead of uvicorn's own shutdown (which closed the listening
socket at once and cancelled running requests mid-body):

1. The drain begins (server/app.py ``begin_drain``): new requests and ``/health`` get 503
   ``shutting_down`` while the socket keeps listening; idle kept-alive connections close, busy
   ones after their response.
2. Requests in flight may finish until the one budget (``shutdown_timeout``, from the start of
   the drain) is spent.
3. Those still running end properly (``end_drain``: a stream its ending and ``[DONE]``, a plain
   request a 503) within :data:`CUT_GRACE` s; then busy connections drop, the rest is cancelled.
4. The socket stops listening, and the application's lifespan shutdown stops the engine.
With ``exit_watchdog`` the process ends ``shutdown_timeout + CUT_GRACE + EXIT_GRACE`` s after it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn

from server import exit_watchdog
from server.app import begin_drain, drain_time_left, end_drain
from server.config_file import ServerSettings
from server.exit_status import ENGINE_DIED_EXIT_STATUS

logger = logging.getLogger("kvserve.cli")

# Seconds the requests ended at the budget's end have to write their last events.
CUT_GRACE = 2.0


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` for ``app`` (server/app.py) around ``engine``; see the module
    docstring. ``engine_died`` tells the caller to exit non-zero."""

    def __init__(self, config: uvicorn.Config, app: Any, engine: Any,
                 settings: ServerSettings, exit_watchdog: bool = False) -> None:
        super().__init__(config)
        self.exit_watchdog = exit_watchdog  # only in a process of its own (kvserve serve)
        self.app = app
        self.engine = engine
        self.settings = settings
        self.engine_died = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.info("signal %d: draining requests in flight (up to %.0fs)", sig,
                        self.settings.shutdown_timeout)
        self._arm_watchdog()
        begin_drain(self.app)
        super().handle_exit(sig, frame)

    def _arm_watchdog(self) -> None:
        if not self.exit_watchdog:
            return
        exit_watchdog.arm(self.settings.shutdown_timeout + CUT_GRACE + exit_watchdog.EXIT_GRACE,
                          lambda: ENGINE_DIED_EXIT_STATUS if self.engine_died else 0)

    async def on_tick(self, counter: int) -> bool:
        # Every 0.1 s on the server's loop: a dead engine can serve nothing again.
        if not self.should_exit and not self.engine.is_healthy:
            self.engine_died = True
            logger.error("the engine died (%s): draining and exiting with status %d so that a "
                         "supervisor restarts the server",
                         self.engine.dead_reason or "its thread stopped",
                         ENGINE_DIED_EXIT_STATUS)
            begin_drain(self.app)
            self.should_exit = True
        return await super().on_tick(counter)

    def _running(self) -> bool:
        return bool(self.server_state.tasks) and not self.force_exit

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        self._arm_watchdog()
        begin_drain(self.app)
        state = self.server_state
        for connection in list(state.connections):  # idle ones close now, busy ones later
            connection.shutdown()
        while self._running() and drain_time_left(self.app) > 0:
            await asyncio.sleep(0.05)
        if self._running():
            aborted = end_drain(self.app)
            logger.warning("shutdown timeout (%gs) reached: %d request(s) still running end "
                           "now (streams: finish_reason \"abort\" and [DONE]; others: 503)",
                           self.settings.shutdown_timeout, aborted)
            loop = asyncio.get_running_loop()
            grace = loop.time() + CUT_GRACE
            while self._running() and loop.time() < grace:
                await asyncio.sleep(0.05)
        for server in self.servers:  # no new connections from now on
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(state.connections):
            cycle = getattr(connection, "cycle", None)
            busy = cycle is not None and not cycle.response_complete
            # Still busy after the grace: a client that is not reading; nothing will reach it.
            (connection.transport.abort if busy else connection.transport.close)()
        await asyncio.sleep(0.1)  # the dropped connections' requests see their client gone
        if state.tasks:
            logger.warning("cancelling %d request(s) that did not end", len(state.tasks))
            for task in list(state.tasks):
                task.cancel()
        if not self.force_exit:
            await self.lifespan.shutdown()
