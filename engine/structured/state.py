"""``StructuredOutputs``: the engine's structured-output state, one per ``EngineCore``.

It owns the backend (engine.structured.routing: xgrammar and llguidance), the vetting of new
constraints (engine.structured.vetting, in a child process a deadline can kill:
engine.structured.vet_worker, or on the compile thread under ``isolation="thread"``), the
compile cache and the mask filler (engine.structured.mask_filler: every row under a deadline),
and counts the constrained rows sampled. All of it is built on first use: a request that never
asks for a constraint never pays for the libraries' tokenizer tables or the child process.
``compile`` and ``submit`` may be called from any thread (the server pre-compiles a request's
constraint on a worker thread, so a constraint that does not compile is a 400 before anything is
queued); masking and the matchers belong to the engine thread. A step's bitmask is filled on
the filler's worker thread either during the forward pass or before it
(``start_mask`` / ``finish_mask``; ``engine.structured.fill_mode`` decides by measurement).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.config.structured import StructuredOutputsConfig
from engine.params.structured import StructuredSpec
from engine.params.thinking import ThinkingGate
from engine.structured.backend import GrammarBackend, GrammarError, Matcher
from engine.structured.cache import GrammarCache
from engine.structured.draft_masks import fill_draft_rows
from engine.structured.fill_mode import FillModeChooser
from engine.structured.gated import GatedMatcher
from engine.structured.head_columns import GrammarColumns, RowSource
from engine.structured.mask_filler import FillJob, MaskFiller, RowFailure
from engine.structured.masking import FilledRows, apply_rows
from engine.structured.stats import StructuredStats

logger = logging.getLogger("kvserve.engine")


class ConstraintFailedError(GrammarError):
    """A request's constraint failed while it ran (its mask past the deadline, an error state,
    no token allowed): that request ends; the client's input is at fault (a 400)."""


@dataclass
class PendingMask:
    """A step's bitmask being filled (``StructuredOutputs.start_mask``): one entry per matcher
    given to it; ``result()`` waits (each row under the deadline) and returns the rows that
    filled; ``failures`` names the others by matcher index."""

    job: FillJob | None
    bitmask: torch.Tensor | None
    rows: list[int]
    overlap: bool
    started: float
    size: int
    _filled: FilledRows | None = None
    failures: dict[int, RowFailure] | None = None

    def result(self) -> FilledRows | None:
        if self.failures is None:
            self.failures = {}
            if self.job is not None:
                by_unit = self.job.wait()
                self.failures = {self.rows[u]: f for u, f in by_unit.items()}
            good = [r for r in self.rows if r not in self.failures]
            self._filled = FilledRows(self.bitmask, good) if good else None
        return self._filled


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 config: StructuredOutputsConfig | str | None = None) -> None:
        if isinstance(config, str):
            config = StructuredOutputsConfig(backend=config)
        self.config = config or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = frozenset(stop_token_ids)
        self._lock = threading.Lock()
        self._backend: Any = None
        self._cache: GrammarCache | None = None
        self._vet: Any = None
        self._filler = MaskFiller(self.config.mask_timeout)
        # Fill bitmasks during the forward pass? None: measured (FillModeChooser); True/False
        # forces it (benchmarks/structured_cost.py's A/B).
        self.overlap_fill: bool | None = None
        self._fill_mode = FillModeChooser()
        self.constrained_rows = 0
        self.constrained_steps = 0
        self.runtime_failures = 0

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            self._ensure_backend()
        return self._backend

    def gated(self, gate: ThinkingGate, compiled: Any = None) -> GatedMatcher:
        """A matcher for a reasoning request: free (or budgeted) thought, then ``compiled``'s
        constraint (none: everything allowed after the thought)."""
        backend = self.backend
        return GatedMatcher(gate, backend.matcher(compiled) if compiled is not None else None)

    def _ensure_backend(self) -> None:
        """The masking backend alone (what a thinking gate without a constraint needs)."""
        if self._backend is None:
            from engine.structured.routing import RoutingBackend

            self._backend = RoutingBackend(self._tokenizer, self._vocab_size, self._stop,
                                           self.config.backend)

    def _ensure(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                cfg = self.config
                self._ensure_backend()
                if cfg.isolation == "process":
                    from engine.structured.vet_worker import VetWorker

                    self._vet = VetWorker(self._tokenizer, self._vocab_size, self._stop,
                                          cfg.backend, cfg.compile_timeout)
                else:
                    from engine.structured.vetting import Vetter

                    self._vet = Vetter(self._backend.libraries, self._stop, cfg.backend)
                self._cache = GrammarCache(self._vet_and_compile,
                                           max_pending=cfg.max_pending_compiles)
            return self._cache

    def _vet_and_compile(self, spec: StructuredSpec) -> Any:
        t0 = time.perf_counter()
        try:
            verdict = self._vet.vet(spec)
        except GrammarError as exc:
            logger.debug("constraint %s refused: %s", spec.describe(), exc)  # the server logs it
            raise
        compiled = self._backend.compile(spec, verdict)
        logger.info("constraint %s: %s, jump-forward %s; vetted and compiled in %.3f s",
                    spec.describe(), verdict.describe(), "on" if verdict.jump_forward else "off",
                    time.perf_counter() - t0)
        return compiled

    def submit(self, spec: StructuredSpec, bounded: bool = False) -> Any:
        """The compiled grammar's future (compiling off the calling thread). ``bounded``:
        ``CompileQueueFullError`` when too many wait (engine.structured.cache)."""
        return self._ensure().submit(spec, bounded)

    def compile(self, spec: StructuredSpec, timeout: float | None = None,
                client: str = "") -> Any:
        """Blocking; raises ``GrammarError`` (a ``ValueError``) naming the problem, or when it
        takes longer than ``timeout`` seconds; ``CompileQueueFullError`` when too many wait
        (in all or from ``client``: engine.structured.compile_queue)."""
        return self._ensure().compile(spec, timeout, client)

    def force(self, spec: StructuredSpec, library: str) -> Any:
        """Compile ``spec`` with ``library`` ("xgrammar" or "llguidance") and serve it so from
        now on, without vetting (A/B tools: benchmarks/structured_cost.py); returns it."""
        from engine.structured.grammar_shape import check_shape
        from engine.structured.vetting import Verdict

        cache = self._ensure()
        compiled = self._backend.compile(spec, Verdict(library, check_shape(spec).jump_forward))
        cache.put(spec, compiled)
        return compiled

    def refuse(self, spec: StructuredSpec, reason: str) -> None:
        """Refuse ``spec`` from now on (a mask of it ran past its deadline)."""
        self._ensure().refuse(spec, reason)

    def matcher(self, compiled: Any) -> Matcher:
        return self.backend.matcher(compiled)

    @property
    def in_use(self) -> bool:
        """A request has carried a constraint or a thinking gate (before that, steps have
        nothing to mask)."""
        return self._backend is not None

    def start_mask(self, matchers: Sequence[Matcher | None]) -> PendingMask | None:
        """Begin filling the bitmask for a step whose sampled rows are ``matchers`` (None for
        an unconstrained row), on the filler's worker: overlapping the forward pass, or waited
        for here and now, whichever ``FillModeChooser`` measured faster. ``finish_mask``
        applies it. None when no row is constrained. The matchers must not advance until
        then."""
        if not self.in_use or all(m is None for m in matchers):
            return None
        overlap = self.overlap_fill
        if overlap is None:
            overlap = self._fill_mode.overlap()
        t0 = time.perf_counter()
        rows = [i for i, m in enumerate(matchers) if m is not None]
        bitmask = self.backend.allocate_bitmask(len(matchers))
        job = self._filler.submit([_row_unit(matchers[r], bitmask, r) for r in rows])
        pending = PendingMask(job, bitmask, rows, overlap, t0, len(matchers))
        if not overlap:
            pending.result()
        return pending

    def finish_mask(self, logits: torch.Tensor, pending: PendingMask | None,
                    skip: Collection[int] = ()) -> dict[int, RowFailure]:
        """Constrain ``logits`` in place with the bitmask ``start_mask`` filled; rows in
        ``skip`` were computed at their allowed tokens only and are left as they are. Returns
        the rows whose fill failed (by index into the matchers given to ``start_mask``): their
        logits are not masked and their requests must end (``failure_error``)."""
        if pending is None:
            return {}
        filled = pending.result()
        self._count(apply_rows(self.backend, logits, filled, skip))
        self._fill_mode.record(pending.overlap, time.perf_counter() - pending.started,
                               pending.size)
        failures = pending.failures or {}
        self.runtime_failures += len(failures)
        return failures

    def _count(self, rows: int) -> None:
        if rows:
            self.constrained_rows += rows
            self.constrained_steps += 1

    def fill_draft(self, matcher: Matcher, draft: Sequence[int]) -> FilledRows:
        """The bitmask of a speculating sequence's verification rows (row ``j`` follows
        ``draft[:j]``; ``engine.structured.draft_masks.fill_draft_rows``), before the forward pass,
        under the mask deadline; ``apply_draft`` applies it. Raises
        ``ConstraintFailedError`` when the fill fails."""
        backend = self.backend

        def unit() -> tuple[FilledRows, str | None]:
            filled = fill_draft_rows(backend, matcher, draft)
            return filled, _row_problem(matcher, filled.bitmask, filled.rows[:1])

        job = self._filler.submit([unit])
        failure = job.wait().get(0)
        if failure is not None:
            self.runtime_failures += 1
            raise ConstraintFailedError(failure_error(failure))
        return job.values[0]

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
        return self.with_compile_stats(StructuredStats(
            constrained_rows=self.constrained_rows, constrained_steps=self.constrained_steps,
            mask_failures=self.runtime_failures, mask_timeouts=self._filler.given_up))

    def with_compile_stats(self, stats: StructuredStats) -> StructuredStats:
        """``stats`` with the compile side's counters as of now: they change off the engine
        thread (a refused constraint never reaches a step), so any thread may read them."""
        cache = self._cache
        if cache is None:
            return stats
        s = cache.stats()
        return dataclasses.replace(
            stats, compiles=s.compiles, compile_failures=s.compile_failures,
            cache_hits=s.cache_hits, compile_seconds_sum=s.compile_seconds_sum,
            compile_buckets=s.compile_buckets, refused_at_once=s.refusal_hits,
            compile_queue_full=s.queue_full, vet_worker_kills=getattr(self._vet, "kills", 0))

    def close(self) -> None:
        """Stop the workers and kill the vetting child; never waits for a fill or a compile."""
        self._filler.close()
        if self._cache is not None:
            self._cache.close()
        close = getattr(self._vet, "close", None)
        if close is not None:
            close()


def failure_error(failure: RowFailure) -> str:
    """The message a request ended by ``failure`` carries."""
    return f"the request's structured-output constraint failed: {failure.reason}"


def _row_problem(matcher: Matcher, bitmask: torch.Tensor, rows: Sequence[int]) -> str | None:
    """Why a just-filled row cannot be sampled from (an error state, nothing allowed)."""
    error = matcher.error()
    if error is not None:
        return f"its grammar stopped ({error})"
    for r in rows:
        if not bool(bitmask[r].any()):
            return "its grammar allows no token here (nothing it accepts can follow)"
    return None


def _row_unit(matcher: Matcher, bitmask: torch.Tensor, row: int):
    def fill() -> tuple[None, str | None]:
        matcher.fill_bitmask(bitmask, row)
        return None, _row_problem(matcher, bitmask, [row])
    return fill
