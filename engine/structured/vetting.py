"""Vetting a constraint before any request runs it: is it finite, which library serves it, and
is its token mask cheap enough to compute at every step.

``Vetter.run(spec)`` yields, in order: the grammar's ``GrammarShape``
(engine.structured.grammar_shape; a grammar that admits no finite output is refused there), then
one ``LibraryProbe`` per candidate library: compiled, then walked along a seeded random path of
up to ``PROBE_STEPS`` tokens (the next library replays the first one's path), each mask fill
timed in CPU seconds of the calling thread. A library is refused when it does not compile the
constraint, when its mask allows nothing where the walk stands, or when one fill takes more than
``SLOW_FILL_S`` or the median more than ``SLOW_MEDIAN_S``. ``decide`` picks the fastest median
among those that passed (llguidance walks first: its parser is bounded by fuel).

It runs in a child process that a deadline can kill (engine.structured.vet_worker), so what it
yields is plain, picklable data; ``decide`` also works on what arrived before the deadline."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.config.structured import BACKENDS
from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarBackend, GrammarError
from engine.structured.grammar_shape import GrammarShape, check_shape
from engine.structured.llguidance_backend import KINDS, LLGuidanceBackend
from engine.structured.xgrammar_backend import XGrammarBackend

PROBE_STEPS = 12
SLOW_FILL_S = 0.25  # CPU seconds one mask fill may take on the probe's walk
SLOW_MEDIAN_S = 0.05  # CPU seconds the median fill may take


@dataclass(frozen=True)
class LibraryProbe:
    """One library's result: ``fill_seconds`` the median CPU seconds of one mask fill on the
    walk, or ``error`` saying why this library cannot serve the constraint."""

    library: str
    fill_seconds: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    """The library that serves a constraint, and whether jump-forward drafts may be made from
    it (its forced text is bounded: ``GrammarShape.jump_forward``)."""

    library: str
    jump_forward: bool
    probes: tuple[LibraryProbe, ...] = ()

    def describe(self) -> str:
        times = ", ".join(f"{p.library} {p.fill_seconds * 1e3:.3f} ms" for p in self.probes
                          if p.fill_seconds is not None)
        return f"{self.library} (mask fill: {times or 'not measured'})"


def candidates(kind: str, policy: str, have_llguidance: bool) -> list[str]:
    """The libraries to probe for a constraint of ``kind`` under ``policy``, in probe order."""
    if policy not in BACKENDS:
        raise ValueError(f"structured-output backend must be one of {', '.join(BACKENDS)}; "
                         f"got {policy!r}")
    if kind not in KINDS or not have_llguidance or policy == "xgrammar":
        return ["xgrammar"]
    return ["llguidance"] if policy == "llguidance" else ["llguidance", "xgrammar"]


class Vetter:
    """Vets constraints with ``libraries`` (name -> backend over one tokenizer); ``stop``: the
    stop tokens, never chosen on a walk."""

    def __init__(self, libraries: dict[str, GrammarBackend], stop: Iterable[int],
                 policy: str = "auto") -> None:
        self.libraries = dict(libraries)
        self.stop = frozenset(int(t) for t in stop)
        self.policy = policy

    @classmethod
    def build(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
              policy: str = "auto") -> Vetter:
        """Its own libraries over ``tokenizer`` (llguidance where installed)."""
        stop = sorted(stop_token_ids)
        libraries: dict[str, GrammarBackend] = {
            "xgrammar": XGrammarBackend(tokenizer, vocab_size, stop, max_threads=1)}
        if policy != "xgrammar":
            try:
                libraries["llguidance"] = LLGuidanceBackend(tokenizer, vocab_size, stop)
            except ImportError:
                if policy == "llguidance":
                    raise ValueError("the llguidance backend needs the llguidance package "
                                     "(pip install llguidance)") from None
        return cls(libraries, stop, policy)

    def run(self, spec: StructuredSpec) -> Iterator[GrammarShape | LibraryProbe]:
        """The shape, then each candidate library's probe (see the module docstring); raises
        ``GrammarError`` for a grammar that admits no finite output."""
        yield check_shape(spec)
        walk: list[int] = []
        for name in candidates(spec.kind, self.policy, "llguidance" in self.libraries):
            yield probe(self.libraries[name], spec, walk, self.stop)

    def vet(self, spec: StructuredSpec) -> Verdict:
        """``run`` to the end and ``decide``, in the calling thread."""
        shape, probes = None, []
        for item in self.run(spec):
            if isinstance(item, GrammarShape):
                shape = item
            else:
                probes.append(item)
        return decide(spec, shape, probes)


def probe(lib: GrammarBackend, spec: StructuredSpec, walk: list[int],
          stop: frozenset[int], steps: int = PROBE_STEPS, seed: int = 0) -> LibraryProbe:
    """Compile ``spec`` with ``lib`` and time its mask fills along ``walk`` (replayed while
    ``lib`` allows it), else along a seeded random path of allowed tokens that is recorded
    into ``walk`` for the next library."""
    try:
        compiled = lib.compile(spec)
    except GrammarError as exc:
        return LibraryProbe(lib.name, error=str(exc))
    matcher = lib.matcher(compiled)
    bits = lib.allocate_bitmask(1)
    rng = random.Random(seed)
    replay, record = list(walk), not walk
    times: list[float] = []
    for step in range(steps):
        t0 = time.thread_time()
        matcher.fill_bitmask(bits, 0)
        seconds = time.thread_time() - t0
        times.append(seconds)
        allowed = allowed_tokens(bits, 0, lib.vocab_size)
        if matcher.error() is not None or not len(allowed):
            where = "admits no output" if step == 0 else \
                f"reaches a state after {step} tokens where no token is allowed"
            return LibraryProbe(lib.name, error=f"the {spec.kind} constraint {where}")
        if seconds > SLOW_FILL_S:
            return LibraryProbe(lib.name, error=_slow(spec, seconds, SLOW_FILL_S, "one"))
        options = [int(t) for t in allowed if int(t) not in stop]
        if not options:
            break
        if record:
            token = rng.choice(options)
            walk.append(token)
        elif replay:
            token = replay.pop(0)
        else:
            break
        if not matcher.accept(token):
            break
    median = statistics.median(times)
    if median > SLOW_MEDIAN_S:
        return LibraryProbe(lib.name, error=_slow(spec, median, SLOW_MEDIAN_S, "the median"))
    return LibraryProbe(lib.name, fill_seconds=median)


def _slow(spec: StructuredSpec, seconds: float, limit: float, which: str) -> str:
    return (f"the {spec.kind} constraint's token mask is too slow to compute: {which} fill "
            f"took {seconds:.3f} s of CPU (at most {limit:g} s); simplify it (nested or "
            f"long bounded repetitions are the usual cause)")


def decide(spec: StructuredSpec, shape: GrammarShape | None, probes: list[LibraryProbe],
           unfinished: str | None = None) -> Verdict:
    """The fastest library that passed; ``GrammarError`` when none did (the reason from the
    library probed first that failed, or ``unfinished``: why the vetting stopped early)."""
    served = [p for p in probes if p.error is None]
    if served:
        best = min(served, key=lambda p: p.fill_seconds or 0.0)
        return Verdict(best.library, bool(shape is not None and shape.jump_forward),
                       tuple(probes))
    errors = sorted((p for p in probes if p.error), key=lambda p: p.library != "xgrammar")
    if unfinished is not None and not any("too slow" in (p.error or "") for p in errors):
        raise GrammarError(unfinished)
    if errors:
        raise GrammarError(errors[0].error)
    raise GrammarError(unfinished or f"the {spec.kind} constraint could not be vetted")


def allowed_tokens(bitmask: torch.Tensor, row: int, width: int) -> np.ndarray:
    """The token ids bit-set in ``row`` of a bitmask (below ``width``)."""
    packed = bitmask[row].contiguous().numpy().view(np.uint8)
    return np.flatnonzero(np.unpackbits(packed, count=width, bitorder="little"))
