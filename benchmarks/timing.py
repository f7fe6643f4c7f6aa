"""Timing helpers shared by the micro-benchmarks in this folder."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(f: Callable[[], object], reps: int = 20) -> float:
    """The fastest of ``reps`` calls of ``f`` (after one unmeasured call), in seconds: the
    least noisy figure of a short operation on a shared machine."""
    f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_step_seconds(llm, prompts, first, full, steps: int) -> tuple[float, list]:
    """Seconds per decode step of ``llm.generate(prompts, full)`` (``steps`` tokens each) with
    the prefill's cost taken out: a run of ``first`` (one token) just before is subtracted.
    Returns it and the full run's outputs."""
    t0 = time.perf_counter()
    llm.generate(prompts, first)
    t1 = time.perf_counter()
    out = llm.generate(prompts, full)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (steps - 1), out
