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
