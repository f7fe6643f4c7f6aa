"""vLLM's profiler endpoints: ``POST /start_profile`` and ``POST /stop_profile``.

Only with ``--profiler-dir DIR`` (vLLM reads ``VLLM_TORCH_PROFILER_DIR``); without it neither
route exists (404). With ``--api-key`` both need the key. ``start`` begins a torch.profiler
session on the engine thread (:class:`engine.profiling.StepProfiler`: CPU and, when present,
CUDA activity, shapes, memory); ``stop`` ends it and answers
``{"status": "stopped", "trace": PATH, "num_steps": N, "seconds": S}``, PATH a Chrome/Perfetto
JSON trace of every engine step in between. Starting twice, or stopping what never started, is
a 409.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.async_engine import EngineDeadError
from server.errors import APIError

# Writing a trace of a long session takes a while (seconds per thousand steps).
STOP_TIMEOUT = 300.0


def add_routes(app: FastAPI, engine: Any, directory: str) -> None:
    from engine.profiling import StepProfiler

    def profiler() -> StepProfiler:  # engine thread
        if engine.profiler is None:
            engine.profiler = StepProfiler(directory)
        return engine.profiler

    async def on_engine(fn, timeout: float) -> dict[str, Any]:
        if not engine.is_healthy:
            raise APIError(503, "the engine is not running", code="engine_dead")
        fut = engine.call_on_engine_thread(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except EngineDeadError:
            raise APIError(503, "the engine is not running", code="engine_dead") from None
        except RuntimeError as exc:
            raise APIError(409, str(exc), code="profiler_state") from None

    @app.post("/start_profile")
    async def start_profile() -> JSONResponse:
        """Start a torch.profiler session over the engine's steps."""
        return JSONResponse(await on_engine(lambda: profiler().start(), 60.0))

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        """Stop the session and write its trace (the answer names the file)."""
        return JSONResponse(await on_engine(lambda: profiler().stop(), STOP_TIMEOUT))
