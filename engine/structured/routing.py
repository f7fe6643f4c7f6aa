"""``RoutingBackend``: the engine's face of both grammar libraries; each constraint is compiled by
the library its vetting chose (engine.structured.vetting).

With ``backend="auto"`` a constraint of a kind both serve (``llguidance_backend.KINDS``) is
probed with both on a seeded random walk and the faster median wins (no library wins
everywhere: docs/decisions.md#grammar-libraries); other kinds (EBNF grammars, structural
tags) are xgrammar's. ``backend="xgrammar"`` / ``"llguidance"`` force a library (for the kinds
llguidance serves; xgrammar keeps the rest). Without the llguidance package, ``auto`` is
xgrammar. ``compile(spec, verdict)`` compiles with the verdict's library; its matchers make
jump-forward drafts only where the verdict allows it (a bounded forced text).

Both libraries use the same bitmask layout, so one step's rows may come from either: the
fill groups matchers by library, and the masking is xgrammar's."""

from __future__ import annotations

import importlib.util
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.config.structured import BACKENDS
from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarBackend, GrammarError, Matcher
from engine.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher
from engine.structured.vetting import Verdict
from engine.structured.xgrammar_backend import XGrammarBackend, XGrammarMatcher


@dataclass(frozen=True)
class Routed:
    """A constraint compiled by the library chosen for it."""

    backend: GrammarBackend
    grammar: Any
    jump_forward: bool = True


class RoutingBackend:
    """xgrammar at once; llguidance on first use (its token tables take ~160 MB for a 49k
    vocabulary: a server whose constraints all go to xgrammar never pays them)."""

    name = "auto"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured-output backend must be one of {', '.join(BACKENDS)}; "
                             f"got {backend!r}")
        self.policy = backend
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        stop = sorted(stop_token_ids)
        self.stop = frozenset(stop)
        # One compile thread, the cache's (niced): a big schema's compile never takes both
        # cores from the engine's steps.
        self.xgrammar = XGrammarBackend(tokenizer, vocab_size, stop, max_threads=1)
        warm(self.xgrammar)
        self._llguidance: LLGuidanceBackend | None = None
        self._has_llguidance = backend != "xgrammar" and _importable("llguidance")
        if backend == "llguidance" and not self._has_llguidance:
            raise ValueError("the llguidance backend needs the llguidance package "
                             "(pip install llguidance)")
        self._lock = threading.Lock()
        self.chosen: Counter[str] = Counter()  # constraints served, per library

    @property
    def llguidance(self) -> LLGuidanceBackend | None:
        """llguidance over this tokenizer, built (and warmed) on first use; None when not
        installed or the policy is xgrammar."""
        if self._llguidance is None and self._has_llguidance:
            with self._lock:
                if self._llguidance is None:
                    lib = LLGuidanceBackend(self._tokenizer, self.vocab_size, sorted(self.stop))
                    warm(lib)
                    self._llguidance = lib
        return self._llguidance

    @property
    def libraries(self) -> dict[str, GrammarBackend]:
        libs: dict[str, GrammarBackend] = {"xgrammar": self.xgrammar}
        if self._has_llguidance:
            libs["llguidance"] = self.llguidance  # type: ignore[assignment]
        return libs

    def compile(self, spec: StructuredSpec, verdict: Verdict) -> Routed:
        """``spec`` compiled by ``verdict.library``; raises ``GrammarError``."""
        lib = self.xgrammar if verdict.library == "xgrammar" else (
            self.llguidance if verdict.library == "llguidance" else None)
        if lib is None:
            raise GrammarError(f"the {verdict.library} library is not available here")
        routed = Routed(lib, lib.compile(spec), verdict.jump_forward)
        self.chosen[lib.name] += 1
        return routed

    def matcher(self, compiled: Routed) -> Matcher:
        return compiled.backend.matcher(compiled.grammar, compiled.jump_forward)

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return self.xgrammar.allocate_bitmask(rows)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        xg = [(m, r) for m, r in zip(matchers, rows) if isinstance(m, XGrammarMatcher)]
        ll = [(m, r) for m, r in zip(matchers, rows) if isinstance(m, LLGuidanceMatcher)]
        for m, r in zip(matchers, rows):  # wrappers (engine.structured.gated) fill themselves
            if not isinstance(m, (XGrammarMatcher, LLGuidanceMatcher)):
                m.fill_bitmask(bitmask, r)
        if xg:
            self.xgrammar.fill_bitmasks([m for m, _ in xg], bitmask, [r for _, r in xg])
        if ll:
            assert self.llguidance is not None
            self.llguidance.fill_bitmasks([m for m, _ in ll], bitmask, [r for _, r in ll])

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        self.xgrammar.apply_bitmask(logits, bitmask, rows)


def warm(lib: GrammarBackend) -> None:
    """Pay a library's first-use costs now (llguidance builds its token tables on the first mask
    of a tokenizer: most of a second), not inside a request's first step, where they would count
    against the mask deadline."""
    matcher = lib.matcher(lib.compile(StructuredSpec.choice(["a", "b"])))
    matcher.fill_bitmask(lib.allocate_bitmask(1), 0)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
