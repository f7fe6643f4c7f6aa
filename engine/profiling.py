"""torch.profiler around the engine thread's steps (vLLM's ``/start_profile`` / ``/stop_profile``).

:class:`StepProfiler` is created and driven on the engine thread only (``AsyncEngine`` runs its
``start``/``stop`` there through ``call_on_engine_thread``; the loop calls :meth:`step` after
each ``EngineCore.step``). It records CPU activity, and CUDA activity when CUDA is available,
with shapes and memory, and writes one Chrome/Perfetto JSON trace per start/stop into its
directory: ``kvserve-trace-<unix ms>.json`` (open it in https://ui.perfetto.dev or
chrome://tracing; both work offline once loaded). Each step is a ``kvserve::step`` range.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any


def profiler_activities() -> list[Any]:
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


class StepProfiler:
    """One profiling session at a time into ``directory`` (created if missing)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._prof: Any = None
        self._started = 0.0
        self.num_steps = 0

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> dict[str, Any]:
        """Start recording; raises RuntimeError if a session is already running."""
        import torch

        if self._prof is not None:
            raise RuntimeError("the profiler is already running: POST /stop_profile first")
        self.directory.mkdir(parents=True, exist_ok=True)
        prof = torch.profiler.profile(activities=profiler_activities(), record_shapes=True,
                                      profile_memory=True, with_stack=False)
        prof.start()
        self._prof, self._started, self.num_steps = prof, time.time(), 0
        return {"status": "started", "directory": str(self.directory)}

    @contextlib.contextmanager
    def step_range(self):
        """Wrap one engine step (a no-op context when not recording)."""
        if self._prof is None:
            yield
            return
        import torch

        with torch.profiler.record_function("kvserve::step"):
            yield
        self._prof.step()
        self.num_steps += 1

    def stop(self) -> dict[str, Any]:
        """Stop and write the trace; raises RuntimeError if no session is running."""
        prof = self._prof
        if prof is None:
            raise RuntimeError("the profiler is not running: POST /start_profile first")
        self._prof = None
        prof.stop()
        path = self.directory / f"kvserve-trace-{int(self._started * 1000)}.json"
        prof.export_chrome_trace(str(path))
        return {"status": "stopped", "trace": str(path), "num_steps": self.num_steps,
                "seconds": round(time.time() - self._started, 3)}
