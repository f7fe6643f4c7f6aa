"""vLLM's profiler endpoints: ``POST /start_profile`` and ``POST /stop_profile``.

Only with ``--profiler-dir DIR``; without it neither route exists (404). With ``--api-key``
both need the key. ``start`` begins a torch.profiler session on the engine thread
(:class:`engine.profiling.StepProfiler`) and answers ``{"status": "started", "session": N,
"max_seconds": S, "max_iters": I}``; a session stops by itself after ``--profiler-max-iters``
engine steps or ``--profiler-max-seconds``. ``stop`` stops the session (or reports the one that
stopped itself since the last ``stop``) and answers ``{"status": "stopped", "trace": PATH,
"num_steps": N, "seconds": S, "stopped_by": "request" | "max_iters" | "max_seconds"}``, PATH a
Chrome/Perfetto JSON trace. The trace is written on a writer thread and awaited here, so the
file is complete when the answer comes; past ``STOP_TIMEOUT`` the answer is ``"status":
"writing"`` and the file appears at PATH once complete (written under ``PATH.partial`` and
renamed). Starting while a session records or its trace is being written, or stopping with
nothing to report, is a 409."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.async_engine import EngineDeadError
from engine.profiling import DEFAULT_MAX_ITERS, DEFAULT_MAX_SECONDS
from server.errors import APIError

# Seconds /stop_profile waits for torch's stop on the engine thread, then for the writer.
STOP_TIMEOUT = 300.0


def add_routes(app: FastAPI, engine: Any, directory: str,
               max_seconds: float = DEFAULT_MAX_SECONDS,
               max_iters: int = DEFAULT_MAX_ITERS) -> None:
    from engine.profiling import StepProfiler

    def profiler() -> StepProfiler:  # engine thread
        if engine.profiler is None:
            engine.profiler = StepProfiler(directory, max_seconds, max_iters)
        return engine.profiler

    async def on_engine(fn, timeout: float) -> Any:
        if not engine.is_healthy:
            raise APIError(503, "the engine is not running", code="engine_dead")
        fut = engine.call_on_engine_thread(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except EngineDeadError:
            raise APIError(503, "the engine is not running", code="engine_dead") from None
        except RuntimeError as exc:
            raise APIError(409, str(exc), code="profiler_state") from None

    def expire(session: int) -> None:  # event loop, max_seconds after a start
        if engine.is_healthy:
            engine.call_on_engine_thread(lambda: profiler().expire(session))

    @app.post("/start_profile")
    async def start_profile() -> JSONResponse:
        """Start a torch.profiler session over the engine's steps (capped)."""
        body = await on_engine(lambda: profiler().start(), 60.0)
        if max_seconds:
            asyncio.get_running_loop().call_later(max_seconds, expire, body["session"])
        return JSONResponse(body)

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        """Stop the session (or report the one that stopped at its cap) and write its trace
        off the engine thread; the answer names the file."""
        done = await on_engine(lambda: profiler().stop(), STOP_TIMEOUT)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done.written)),
                                   STOP_TIMEOUT)
        except asyncio.TimeoutError:
            return JSONResponse({"status": "writing", **done.info})
        except Exception as exc:  # noqa: BLE001 - disk full, directory gone
            raise APIError(500, f"writing the trace {done.info['trace']} failed: "
                                f"{type(exc).__name__}: {exc}",
                           code="profiler_write_failed") from None
        return JSONResponse({"status": "stopped", **done.info})
