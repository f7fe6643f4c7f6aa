"""``GrammarCache``: compiles constraints off the engine thread, once per canonical text.

``submit(spec)`` returns a ``Future`` of the compiled grammar at once (a finished one on a cache
hit); the compile runs on the cache's own worker thread, so neither the event loop nor the engine
thread ever waits on it. ``compile(spec)`` blocks until it is done and raises the
``GrammarError`` (the server calls it on a worker thread before submitting, so that a constraint
that does not compile is a 400). Failed compiles are not kept: the next request retries. The
cache holds at most ``capacity`` grammars (least recently used dropped). Thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine.structured.backend import GrammarBackend, GrammarError
from engine.structured.spec import StructuredSpec
from engine.structured.stats import COMPILE_BUCKETS


@dataclass(frozen=True)
class GrammarCacheStats:
    compiles: int  # finished compiles (successful or not)
    compile_failures: int
    cache_hits: int  # submits answered by a grammar compiled (or compiling) before
    compile_seconds_sum: float
    compile_buckets: tuple[int, ...]  # per COMPILE_BUCKETS bound, then +inf: non-cumulative


class GrammarCache:
    def __init__(self, backend: GrammarBackend, capacity: int = 256, workers: int = 1) -> None:
        self.backend = backend
        self.capacity = capacity
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvserve-grammar")
        self._hits = 0
        self._compiles = 0
        self._failures = 0
        self._seconds = 0.0
        self._buckets = [0] * (len(COMPILE_BUCKETS) + 1)

    def submit(self, spec: StructuredSpec) -> Future:
        with self._lock:
            fut = self._futures.get(spec.key)
            if fut is not None:
                self._hits += 1
                self._futures.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._futures[spec.key] = fut
            while len(self._futures) > self.capacity:
                self._futures.popitem(last=False)
            return fut

    def compile(self, spec: StructuredSpec, timeout: float | None = None) -> Any:
        """The compiled grammar (blocking); raises ``GrammarError`` if it does not compile, or
        does not within ``timeout`` seconds (the compile goes on and is cached if it ends)."""
        try:
            return self.submit(spec).result(timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the {spec.kind} constraint did not compile within {timeout:g} "
                               f"s; simplify it") from None

    def _compile(self, spec: StructuredSpec) -> Any:
        t0 = time.perf_counter()
        try:
            return self.backend.compile(spec)
        except BaseException:
            with self._lock:
                self._failures += 1
                if self._futures.get(spec.key) is not None:
                    del self._futures[spec.key]
            raise
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._compiles += 1
                self._seconds += dt
                self._buckets[next((i for i, b in enumerate(COMPILE_BUCKETS) if dt <= b),
                                   len(COMPILE_BUCKETS))] += 1

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(self._compiles, self._failures, self._hits, self._seconds,
                                     tuple(self._buckets))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
