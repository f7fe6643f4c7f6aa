"""``GrammarCache``: vets and compiles constraints off the engine thread, once per canonical text.

``submit(spec)`` returns a ``Future`` of the compiled grammar at once (a finished one on a cache
hit); ``compile_fn`` (vet, then compile) runs on the cache's own worker thread, a niced daemon,
so neither the event loop nor the engine thread ever waits on it. ``compile`` blocks until done
and raises the ``GrammarError`` (the server calls it on a worker thread first: a 400).

Bounds: at most ``max_pending`` constraints wait, a quarter of them (at least one) per client,
the least recently served client's first (engine.structured.compile_queue); one more is a
``CompileQueueFullError`` (a 503). A refused constraint is remembered for ``refusal_ttl``
seconds (at most ``MAX_REFUSALS``), so a repeat gets its 400 at once; ``refuse`` adds one found
at run time. At most ``capacity`` compiled grammars are held (least recently used dropped).
Thread-safe."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarError
from engine.structured.compile_queue import CompileQueue, CompileQueueFullError
from engine.structured.stats import COMPILE_BUCKETS

MAX_REFUSALS = 4096
COMPILE_NICENESS = 5


@dataclass(frozen=True)
class GrammarCacheStats:
    compiles: int  # finished compiles (successful or not)
    compile_failures: int
    cache_hits: int  # submits answered by a grammar compiled (or compiling) before
    compile_seconds_sum: float
    compile_buckets: tuple[int, ...]  # per COMPILE_BUCKETS bound, then +inf: non-cumulative
    refusal_hits: int = 0  # submits refused at once: the constraint was refused before
    queue_full: int = 0  # submits turned away: max_pending were waiting


class GrammarCache:
    def __init__(self, compile_fn: Callable[[StructuredSpec], Any], capacity: int = 256,
                 max_pending: int = 8, refusal_ttl: float = 600.0) -> None:
        self._compile_fn = compile_fn
        self.capacity = capacity
        self.max_pending = max_pending
        self.refusal_ttl = refusal_ttl
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._refused: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._queue: CompileQueue[tuple[StructuredSpec, Future]] = CompileQueue(
            max_pending, max(1, max_pending // 4))
        self._thread = threading.Thread(target=self._work, name="kvserve-grammar", daemon=True)
        self._thread.start()
        self._hits = self._refusal_hits = self._queue_full = 0
        self._compiles = 0
        self._failures = 0
        self._seconds = 0.0
        self._buckets = [0] * (len(COMPILE_BUCKETS) + 1)

    def submit(self, spec: StructuredSpec, bounded: bool = True, client: str = "") -> Future:
        """The compiled grammar's future. ``bounded``: raise ``CompileQueueFullError`` when
        ``max_pending`` constraints already wait, or a quarter of them from ``client`` (the
        engine itself submits unbounded: what it submits was admitted already)."""
        with self._lock:
            refused = self._refused.get(spec.key)
            if refused is not None and refused[1] > time.monotonic():
                self._refusal_hits += 1
                fut: Future = Future()
                fut.set_exception(GrammarError(refused[0]))
                return fut
            fut = self._futures.get(spec.key)
            if fut is not None:
                self._hits += 1
                self._futures.move_to_end(spec.key)
                return fut
            fut = Future()
            try:
                self._queue.put(client, (spec, fut), bounded)
            except CompileQueueFullError:
                self._queue_full += 1
                raise
            self._futures[spec.key] = fut
            while len(self._futures) > self.capacity:
                self._futures.popitem(last=False)
        return fut

    def compile(self, spec: StructuredSpec, timeout: float | None = None,
                client: str = "") -> Any:
        """The compiled grammar (blocking); raises ``GrammarError`` if it does not compile, or
        does not within ``timeout`` seconds (the compile goes on and is cached if it ends)."""
        try:
            return self.submit(spec, client=client).result(timeout)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the {spec.kind} constraint did not compile within {timeout:g} "
                               f"s; simplify it") from None

    def put(self, spec: StructuredSpec, compiled: Any) -> None:
        """Serve ``spec`` with ``compiled`` from now on (A/B tools forcing a library)."""
        fut: Future = Future()
        fut.set_result(compiled)
        with self._lock:
            self._refused.pop(spec.key, None)
            self._futures[spec.key] = fut

    def refuse(self, spec: StructuredSpec, reason: str) -> None:
        """From now on (for ``refusal_ttl`` seconds) ``spec`` is refused with ``reason``."""
        with self._lock:
            self._futures.pop(spec.key, None)
            self._remember(spec, reason)

    def _remember(self, spec: StructuredSpec, reason: str) -> None:
        self._refused[spec.key] = (reason, time.monotonic() + self.refusal_ttl)
        self._refused.move_to_end(spec.key)
        while len(self._refused) > MAX_REFUSALS:
            self._refused.popitem(last=False)

    def _work(self) -> None:
        lower_thread_priority(COMPILE_NICENESS)
        while True:
            got = self._queue.get()
            if got is None:
                return
            client, (spec, fut) = got
            try:
                if fut.set_running_or_notify_cancel():
                    self._run(spec, fut)
            finally:
                self._queue.done(client)

    def _run(self, spec: StructuredSpec, fut: Future) -> None:
        t0 = time.perf_counter()
        try:
            result = self._compile_fn(spec)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            with self._lock:
                self._failures += 1
                if self._futures.get(spec.key) is fut:
                    del self._futures[spec.key]
                if isinstance(exc, GrammarError):
                    self._remember(spec, str(exc))
            fut.set_exception(exc)
        else:
            fut.set_result(result)
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
                                     tuple(self._buckets), self._refusal_hits, self._queue_full)

    def close(self) -> None:
        """Stop taking work; pending futures are cancelled. Never waits for a compile."""
        for _, fut in self._queue.drain():
            fut.cancel()


def lower_thread_priority(niceness: int) -> None:
    """Raise the calling thread's nice value by ``niceness`` (Linux: per thread, inherited by
    the threads it starts); elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
        except OSError:
            pass
