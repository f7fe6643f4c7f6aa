"""``StructuredOutputs``: the engine's structured-output state, one per ``EngineCore``.

It owns the backend (engine.structured.routing: xgrammar and llguidance, each constraint
served by the library measured faster for it; built on first use: a request that never asks for
a constraint never pays for the libraries' tokenizer tables) and the compile cache, and counts the constrained rows
sampled. ``compile`` and ``submit`` may be called from any thread (the server pre-compiles a
request's constraint on a worker thread, so a constraint that does not compile is a 400 before
anything is queued); masking and the matchers belong to the engine thread, which may hand a
step's bitmask fill to one worker thread of its own while the forward pass runs
(``start_mask`` / ``finish_mask``; ``engine.structured.fill_mode`` decides by measurement).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.structured.backend import GrammarBackend, Matcher
from engine.structured.cache import GrammarCache
from engine.structured.drafts import fill_draft_rows
from engine.structured.fill_mode import FillModeChooser
from engine.structured.head_columns import GrammarColumns, RowSource
from engine.structured.masking import FilledRows, apply_rows, fill_rows
from engine.structured.spec import StructuredSpec
from engine.structured.stats import StructuredStats


@dataclass(frozen=True)
class PendingMask:
    """A step's bitmask being filled (``StructuredOutputs.start_mask``)."""

    future: Future
    overlap: bool
    started: float
    rows: int


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 backend: str = "auto") -> None:
        self._tokenizer = tokenizer
        self._policy = backend  # engine.structured.routing
        self._vocab_size = vocab_size
        self._stop = frozenset(stop_token_ids)
        self._lock = threading.Lock()
        self._backend: GrammarBackend | None = None
        self._cache: GrammarCache | None = None
        self._filler: ThreadPoolExecutor | None = None
        # Fill bitmasks during the forward pass? None: measured (FillModeChooser); True/False
        # forces it (benchmarks/structured_cost.py's A/B).
        self.overlap_fill: bool | None = None
        self._fill_mode = FillModeChooser()
        self.constrained_rows = 0
        self.constrained_steps = 0

    @property
    def backend(self) -> GrammarBackend:
        self._ensure()
        assert self._backend is not None
        return self._backend

    def _ensure(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                from engine.structured.routing import RoutingBackend

                self._backend = RoutingBackend(self._tokenizer, self._vocab_size, self._stop,
                                               self._policy)
                self._cache = GrammarCache(self._backend)
            return self._cache

    def submit(self, spec: StructuredSpec) -> Future:
        """The compiled grammar's future (compiling off the calling thread)."""
        return self._ensure().submit(spec)

    def compile(self, spec: StructuredSpec, timeout: float | None = None) -> Any:
        """Blocking; raises ``GrammarError`` (a ``ValueError``) naming the problem, or when it
        takes longer than ``timeout`` seconds."""
        return self._ensure().compile(spec, timeout)

    def matcher(self, compiled: Any) -> Matcher:
        return self.backend.matcher(compiled)

    @property
    def in_use(self) -> bool:
        """A request has carried a constraint (before that, steps have nothing to mask)."""
        return self._cache is not None

    def start_mask(self, matchers: Sequence[Matcher | None]) -> PendingMask | None:
        """Begin filling the bitmask for a step whose sampled rows are ``matchers`` (None for
        an unconstrained row): on a worker thread, overlapping the forward pass, or here and
        now, whichever ``FillModeChooser`` measured faster. ``finish_mask`` applies it. None
        when no row is constrained. The matchers must not advance until then."""
        if not self.in_use or all(m is None for m in matchers):
            return None
        overlap = self.overlap_fill
        if overlap is None:
            overlap = self._fill_mode.overlap()
        t0 = time.perf_counter()
        if overlap:
            if self._filler is None:
                self._filler = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar-mask")
            future = self._filler.submit(fill_rows, self.backend, list(matchers))
        else:
            future = Future()
            future.set_result(fill_rows(self.backend, matchers))
        return PendingMask(future, overlap, t0, len(matchers))

    def finish_mask(self, logits: torch.Tensor, pending: PendingMask | None,
                    skip: Collection[int] = ()) -> None:
        """Constrain ``logits`` in place with the bitmask ``start_mask`` filled; rows in
        ``skip`` were computed at their allowed tokens only and are left as they are."""
        if pending is None:
            return
        self._count(apply_rows(self.backend, logits, pending.future.result(), skip))
        self._fill_mode.record(pending.overlap, time.perf_counter() - pending.started,
                               pending.rows)

    def _count(self, rows: int) -> None:
        if rows:
            self.constrained_rows += rows
            self.constrained_steps += 1

    def fill_draft(self, matcher: Matcher, draft: Sequence[int]) -> FilledRows:
        """The bitmask of a speculating sequence's verification rows (row ``j`` follows
        ``draft[:j]``; ``engine.structured.drafts.fill_draft_rows``), before the forward pass;
        ``apply_draft`` applies it."""
        return fill_draft_rows(self.backend, matcher, draft)

    def apply_draft(self, logits: torch.Tensor, filled: FilledRows,
                    skip: Collection[int] = ()) -> None:
        """Constrain a speculating sequence's verification rows (``logits``, its rows only)
        in place with ``fill_draft``'s bitmask; rows in ``skip`` are left as they are."""
        self._count(apply_rows(self.backend, logits, filled, skip))

    def columns(self, rows: Sequence[RowSource]) -> GrammarColumns:
        """The step's sampled rows as vocabulary columns for the logits head
        (``engine.structured.head_columns``)."""
        return GrammarColumns(self.backend.vocab_size, rows)

    def stats(self) -> StructuredStats:
        cache = self._cache
        if cache is None:
            return StructuredStats()
        s = cache.stats()
        return StructuredStats(s.compiles, s.compile_failures, s.cache_hits,
                               s.compile_seconds_sum, s.compile_buckets,
                               self.constrained_rows, self.constrained_steps)

    def close(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=True)
        if self._cache is not None:
            self._cache.close()
