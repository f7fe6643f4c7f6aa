"""torch.profiler around the engine thread's steps (vLLM's ``/start_profile`` / ``/stop_profile``).

:class:`StepProfiler` is created and driven on the engine thread only (``AsyncEngine`` runs its
``start``/``stop``/``expire`` there; the loop wraps each ``EngineCore.step`` in
:meth:`StepProfiler.step_range`, a ``kvserve::step`` range). It records CPU activity, and CUDA
activity when available, into one Chrome/Perfetto JSON trace per session,
``kvserve-trace-<unix ms>.json`` in its directory.

Bounds on what a session costs the engine: one session at a time (``start`` raises, the route's
409, while one records or its trace is still being written); caps (``max_iters`` steps,
``max_seconds``, checked after each step and by :meth:`StepProfiler.expire` on a timer; 0 turns a
cap off), which bound the engine's pause at stop (torch's stop must run on the engine thread and
its export holds the GIL); only torch's stop on the engine thread, the export, freeing and
``malloc_trim`` on a ``kvserve-profile-writer`` thread, the trace written under ``.partial`` and
renamed; no shapes, memory events or stacks recorded (vLLM's defaults too)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvserve.engine")

DEFAULT_MAX_SECONDS = 30.0
DEFAULT_MAX_ITERS = 1000


def profiler_activities() -> list[Any]:
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


@dataclass(frozen=True)
class TraceWrite:
    """A stopped session: ``info`` (``trace`` path, ``num_steps``, ``seconds``, ``stopped_by``:
    "request", "max_iters" or "max_seconds") known at once, and ``written``, a Future that
    resolves (to None) once the trace file is complete, or fails with the writer's error."""

    info: dict[str, Any]
    written: concurrent.futures.Future


class StepProfiler:
    """One profiling session at a time into ``directory`` (created if missing), capped at
    ``max_seconds`` and ``max_iters`` engine steps (0: no cap). Engine thread only."""

    def __init__(self, directory: str | Path, max_seconds: float = DEFAULT_MAX_SECONDS,
                 max_iters: int = DEFAULT_MAX_ITERS) -> None:
        if not max_seconds >= 0 or max_iters < 0:
            raise ValueError("the profiler's caps cannot be negative (0: no cap)")
        self.directory = Path(directory)
        self.max_seconds, self.max_iters = max_seconds, max_iters
        self._prof: Any = None
        self._started = 0.0  # wall clock, names the trace
        self._t0 = 0.0  # monotonic
        self.num_steps = 0
        self.session = 0  # increments at each start
        self._last: TraceWrite | None = None  # the last stopped session
        self._unreported: TraceWrite | None = None  # one that stopped itself, until stop()

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> dict[str, Any]:
        """Start recording; raises RuntimeError if a session records or its trace is still
        being written."""
        import torch

        if self._prof is not None:
            raise RuntimeError("the profiler is already running: POST /stop_profile first")
        if self._last is not None and not self._last.written.done():
            raise RuntimeError("the previous session's trace is still being written "
                               f"({self._last.info['trace']}); retry when it is done")
        self.directory.mkdir(parents=True, exist_ok=True)
        prof = torch.profiler.profile(activities=profiler_activities(), record_shapes=False,
                                      profile_memory=False, with_stack=False)
        prof.start()
        self._prof, self._started, self._t0 = prof, time.time(), time.monotonic()
        self.num_steps = 0
        self.session += 1
        self._unreported = None
        return {"status": "started", "directory": str(self.directory), "session": self.session,
                "max_seconds": self.max_seconds, "max_iters": self.max_iters}

    @contextlib.contextmanager
    def step_range(self):
        """Wrap one engine step (a no-op context when not recording); the session stops
        itself after the step that reaches a cap."""
        if self._prof is None:
            yield
            return
        import torch

        with torch.profiler.record_function("kvserve::step"):
            yield
        self._prof.step()
        self.num_steps += 1
        if self.max_iters and self.num_steps >= self.max_iters:
            self._finish("max_iters")
        elif self.max_seconds and time.monotonic() - self._t0 >= self.max_seconds:
            self._finish("max_seconds")

    def expire(self, session: int) -> None:
        """The seconds cap's timer: stop ``session`` if it is still the one recording."""
        if self._prof is not None and session == self.session:
            self._finish("max_seconds")

    def stop(self) -> TraceWrite:
        """Stop the session (or report the one that stopped itself since the last stop); the
        trace is written on a writer thread. Raises RuntimeError if there is neither."""
        if self._prof is not None:
            return self._finish("request")
        if self._unreported is not None:
            done, self._unreported = self._unreported, None
            return done
        raise RuntimeError("the profiler is not running: POST /start_profile first")

    def _finish(self, reason: str) -> TraceWrite:
        prof, self._prof = self._prof, None
        prof.stop()  # here: torch.profiler must stop on the thread that started it
        path = self.directory / f"kvserve-trace-{int(self._started * 1000)}.json"
        info = {"trace": str(path), "num_steps": self.num_steps,
                "seconds": round(time.monotonic() - self._t0, 3), "stopped_by": reason}
        written: concurrent.futures.Future = concurrent.futures.Future()
        held = [prof]  # the writer takes the only reference, so it frees the events
        del prof
        threading.Thread(target=_write, args=(held, path, written), daemon=True,
                         name="kvserve-profile-writer").start()
        self._last = TraceWrite(info, written)
        if reason != "request":
            self._unreported = self._last
            logger.info("profiler: session stopped at its cap (%s) after %d steps; trace %s",
                        reason, info["num_steps"], path)
        return self._last


def _write(held: list[Any], path: Path, written: concurrent.futures.Future) -> None:
    """Writer thread: export the stopped profiler ``held[0]`` to ``path``, free it, trim."""
    partial = path.with_name(path.name + ".partial")
    try:
        prof = held.pop()
        try:
            prof.export_chrome_trace(str(partial))
        finally:
            # The recorded events (often hundreds of MiB) live in prof.profiler; prof itself
            # is in a reference cycle (its action map holds its bound methods), so dropping
            # prof alone would leave them to the garbage collector.
            prof.profiler = None
            del prof
        os.replace(partial, path)
    except BaseException as exc:  # noqa: BLE001 - the route reports it
        logger.exception("profiler: writing %s failed", path)
        with contextlib.suppress(OSError):
            partial.unlink()
        written.set_exception(exc)
    else:
        written.set_result(None)
    finally:
        trim_heap()


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
