"""Filling a step's grammar bitmasks on a worker thread, each row under a deadline.

A mask fill is one uninterruptible call into a grammar library, and a grammar can turn slow on
a path vetting did not take. So ``MaskFiller`` runs every fill on a worker thread (both
libraries release the GIL), and ``FillJob.wait`` waits for each row at most ``deadline`` seconds
from the moment that row's fill began. A row past it is reported failed (its request ends), its
worker retired (it finishes into a bitmask nobody reads and exits) and a fresh worker runs the
rows after it; a row whose matcher is in error, or whose mask allows no token, fails the same
way. Every other row's bits are exactly those of an unbounded fill.

Workers are daemon threads: a fill that never ends can hold neither a step nor the process's
exit. One job at a time is in flight (the engine thread waits on each before the next); the
worker count only grows by the rows given up."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvserve.engine")

# A unit of work: one row's fill (or one draft's rows); returns (value, failure reason or None).
Unit = Callable[[], tuple[Any, str | None]]


@dataclass(frozen=True)
class RowFailure:
    """Unit ``index`` of a job failed: ``timed_out`` (past the deadline) or ``reason`` from the
    fill itself (an error state, nothing allowed)."""

    index: int
    reason: str
    timed_out: bool = False


class _Worker(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="kvserve-grammar-mask", daemon=True)
        self.jobs: queue.SimpleQueue[tuple[FillJob, list[int]] | None] = queue.SimpleQueue()
        self.retired = False

    def run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            job, indices = item
            for i in indices:
                if not job._claim(i, self):
                    continue
                try:
                    value, failure = job.units[i]()
                except Exception as exc:  # noqa: BLE001 - the row fails, the engine goes on
                    value, failure = None, f"{type(exc).__name__}: {exc}"
                job._finish(i, value, failure)
                if self.retired:
                    return
            if self.retired:
                return


class FillJob:
    """Units submitted together; ``wait`` returns once each has finished or been given up."""

    def __init__(self, filler: MaskFiller, units: Sequence[Unit]) -> None:
        self._filler = filler
        self.units = list(units)
        n = len(self.units)
        self._cond = threading.Condition()
        self._owner: list[_Worker | None] = [None] * n
        self._started: list[float | None] = [None] * n
        self._done = [False] * n
        self.values: list[Any] = [None] * n
        self.failures: dict[int, RowFailure] = {}
        self._waited = False

    # worker side
    def _claim(self, i: int, worker: _Worker) -> bool:
        with self._cond:
            if self._owner[i] is not worker or self._done[i]:
                return False
            self._started[i] = time.monotonic()
            self._cond.notify_all()
            return True

    def _finish(self, i: int, value: Any, failure: str | None) -> None:
        with self._cond:
            if self._done[i]:  # given up already: the value goes nowhere
                return
            self._done[i] = True
            self.values[i] = value
            if failure is not None:
                self.failures[i] = RowFailure(i, failure)
            self._cond.notify_all()

    # engine side
    def _dispatch(self, indices: list[int], worker: _Worker) -> None:
        for i in indices:
            self._owner[i] = worker
        if indices:
            worker.jobs.put((self, indices))

    def wait(self) -> dict[int, RowFailure]:
        """Block until every unit finished or was given up; returns the failures by unit.
        Idempotent."""
        deadline = self._filler.deadline
        with self._cond:
            while not all(self._done):
                now = time.monotonic()
                running = [(s, i) for i, s in enumerate(self._started)
                           if s is not None and not self._done[i]]
                if not running:
                    self._cond.wait(deadline)  # the next unit is about to start
                    continue
                started, i = min(running)
                left = started + deadline - now
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._give_up(i)
            self._waited = True
            return dict(self.failures)

    def _give_up(self, i: int) -> None:
        stuck = self._owner[i]
        self._done[i] = True
        self.failures[i] = RowFailure(i, f"its grammar's token mask took longer than "
                                         f"{self._filler.deadline:g} s to compute", True)
        rest = [j for j, w in enumerate(self._owner)
                if w is stuck and not self._done[j] and self._started[j] is None]
        fresh = self._filler._replace(stuck)
        self._dispatch(rest, fresh)


class MaskFiller:
    """Runs ``FillJob``s on a worker thread; ``deadline`` seconds per unit."""

    def __init__(self, deadline: float) -> None:
        if deadline <= 0:
            raise ValueError(f"the mask deadline must be positive; got {deadline}")
        self.deadline = deadline
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self.given_up = 0  # units given up at the deadline, cumulative
        self._retired: list[_Worker] = []

    def submit(self, units: Sequence[Unit]) -> FillJob:
        job = FillJob(self, units)
        with self._lock:
            if self._worker is None:
                self._worker = _Worker()
                self._worker.start()
            worker = self._worker
        with job._cond:
            job._dispatch(list(range(len(job.units))), worker)
        return job

    def _replace(self, stuck: _Worker | None) -> _Worker:
        with self._lock:
            self.given_up += 1
            if stuck is not None:
                stuck.retired = True
                self._retired = [w for w in self._retired if w.is_alive()] + [stuck]
            self._worker = _Worker()
            self._worker.start()
            if len(self._retired) > 1:
                logger.warning("%d grammar mask fills are still running past their deadline",
                               len(self._retired))
            return self._worker

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.jobs.put(None)
                self._worker = None
