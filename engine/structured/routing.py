"""``RoutingBackend``: each constraint served by the grammar library measured faster for it.

No one library wins everywhere: xgrammar fills a JSON schema's mask faster than llguidance,
llguidance a bounded-repetition regex's much faster than xgrammar
(docs/performance.md#grammar-libraries). So with ``backend="auto"`` a constraint of a
kind both serve (engine.structured.llguidance_backend.KINDS) is compiled by both, and
``fill_seconds`` walks both matchers along the same seeded random path of tokens both allow,
timing each mask fill; the faster median wins. That costs one extra compile and a few fills per
distinct constraint, on the compile thread, once (compiles are cached by canonical text).
Other kinds (EBNF grammars, structural tags) are xgrammar's; a constraint only one library
compiles goes to that one. ``backend="xgrammar"`` / ``"llguidance"`` force a library (for the
kinds llguidance serves; xgrammar keeps the rest). Without the llguidance package installed,
``auto`` is xgrammar.

Both libraries use the same bitmask layout, so one step's rows may come from either: the
fill groups matchers by library, and the masking is xgrammar's.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.structured.backend import GrammarBackend, GrammarError, Matcher
from engine.structured.config import BACKENDS
from engine.structured.llguidance_backend import KINDS, LLGuidanceBackend, LLGuidanceMatcher
from engine.structured.spec import StructuredSpec
from engine.structured.xgrammar_backend import XGrammarBackend

logger = logging.getLogger("kvserve.engine")
PROBE_STEPS = 12


@dataclass(frozen=True)
class Routed:
    """A constraint compiled by the library chosen for it."""

    backend: GrammarBackend
    grammar: Any


class RoutingBackend:
    name = "auto"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured-output backend must be one of {', '.join(BACKENDS)}; "
                             f"got {backend!r}")
        self.policy = backend
        self.vocab_size = vocab_size
        stop = sorted(stop_token_ids)
        self._stop = frozenset(stop)
        self.xgrammar = XGrammarBackend(tokenizer, vocab_size, stop)
        self.llguidance: LLGuidanceBackend | None = None
        if backend != "xgrammar":
            try:
                self.llguidance = LLGuidanceBackend(tokenizer, vocab_size, stop)
            except ImportError:
                if backend == "llguidance":
                    raise ValueError("the llguidance backend needs the llguidance package "
                                     "(pip install llguidance)") from None
        self.chosen: Counter[str] = Counter()  # constraints served, per library

    def compile(self, spec: StructuredSpec) -> Routed:
        llg = self.llguidance if spec.kind in KINDS else None
        if llg is None or self.policy == "xgrammar":
            return self._routed(self.xgrammar, self.xgrammar.compile(spec))
        if self.policy == "llguidance":
            return self._routed(llg, llg.compile(spec))
        compiled: dict[str, Any] = {}
        error: GrammarError | None = None
        for lib in (self.xgrammar, llg):
            try:
                compiled[lib.name] = lib.compile(spec)
            except GrammarError as exc:
                error = error or exc
        if not compiled:
            assert error is not None
            raise error
        if len(compiled) == 1:
            lib = self.xgrammar if "xgrammar" in compiled else llg
            return self._routed(lib, compiled[lib.name])
        tx, tl = fill_seconds(self.xgrammar, compiled["xgrammar"], llg, compiled["llguidance"],
                              self._stop)
        lib = llg if tl < tx else self.xgrammar
        logger.info("constraint %s: %s (mask fill %.3f ms; xgrammar %.3f ms, llguidance %.3f "
                    "ms)", spec.describe(), lib.name, min(tx, tl) * 1e3, tx * 1e3, tl * 1e3)
        return self._routed(lib, compiled[lib.name])

    def _routed(self, lib: GrammarBackend, grammar: Any) -> Routed:
        self.chosen[lib.name] += 1
        return Routed(lib, grammar)

    def matcher(self, compiled: Routed) -> Matcher:
        return compiled.backend.matcher(compiled.grammar)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self.xgrammar.allocate_bitmask(rows)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        xg = [(m, r) for m, r in zip(matchers, rows) if not isinstance(m, LLGuidanceMatcher)]
        ll = [(m, r) for m, r in zip(matchers, rows) if isinstance(m, LLGuidanceMatcher)]
        if xg:
            self.xgrammar.fill_bitmasks([m for m, _ in xg], bitmask, [r for _, r in xg])
        if ll:
            assert self.llguidance is not None
            self.llguidance.fill_bitmasks([m for m, _ in ll], bitmask, [r for _, r in ll])

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        self.xgrammar.apply_bitmask(logits, bitmask, rows)


def allowed_tokens(bitmask: torch.Tensor, row: int, width: int) -> np.ndarray:
    """The token ids bit-set in ``row`` of a bitmask (below ``width``)."""
    packed = bitmask[row].contiguous().numpy().view(np.uint8)
    return np.flatnonzero(np.unpackbits(packed, count=width, bitorder="little"))


def fill_seconds(a: GrammarBackend, ca: Any, b: GrammarBackend, cb: Any,
                 stop: frozenset[int], steps: int = PROBE_STEPS, seed: int = 0
                 ) -> tuple[float, float]:
    """Median seconds of one mask fill by ``a`` (compiled ``ca``) and by ``b`` (``cb``) along
    one seeded random walk of up to ``steps`` tokens both allow (stop tokens aside)."""
    ma, mb = a.matcher(ca), b.matcher(cb)
    bits_a, bits_b = a.allocate_bitmask(1), b.allocate_bitmask(1)
    rng = random.Random(seed)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for m, bits, out in ((ma, bits_a, times[0]), (mb, bits_b, times[1])):
            t0 = time.perf_counter()
            m.fill_bitmask(bits, 0)
            out.append(time.perf_counter() - t0)
        both = np.intersect1d(allowed_tokens(bits_a, 0, a.vocab_size),
                              allowed_tokens(bits_b, 0, b.vocab_size))
        options = [int(t) for t in both if int(t) not in stop]
        if not options:
            break
        token = rng.choice(options)
        if not (ma.accept(token) and mb.accept(token)):
            break
    return statistics.median(times[0]), statistics.median(times[1])
