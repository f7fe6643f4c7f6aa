"""``--activation-precision auto``'s measurement: the model's packed linears at one row (a
decode step's shape) on the int8 kernels and on the faithful float32 kernel, interleaved, and a
decision that noise cannot flip.

The pass calls every packed part (a ``QuantConcat``'s parts one by one, the logits head too) on
one random row, up to :data:`SAMPLE_BYTES` of weights (every part of a small model; the first
layers' of a large one, still more bytes than a cache holds). The two sides alternate
(int8, faithful, int8, faithful: each switch converts the weights in place, exactly, one
weight at a time), each side timed :data:`RUNS_PER_TURN` times per turn.

The rule (:func:`decide`): the faithful kernel when its kept runs (the slowest quarter
dropped, as the start-up probe does) are all within ``1 + margin`` of int8's fastest kept run;
int8 when they are all beyond ``1 + margin`` of int8's slowest kept run; otherwise no verdict
(the caller's documented default). A stall only adds time, so a side whose true time is within
the margin can only lose to a stall on every one of its runs while the other side had none; a
burst of load can do that to one measurement, so a verdict against the documented default
stands only when a second, independent measurement agrees with it: the two measurements' runs
are decided together (:func:`confirmed`), and a burst over one of them leaves no verdict.
The packed linears are most of a one-row decode step but not all of it (attention, norms,
sampling cost the same on either side), so the step's ratio is nearer 1 than this pass's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.quantization.linear import QuantConcat, QuantLinear
from engine.quantization.verdict import _kept

SAMPLE_BYTES = 256 * 2**20  # the weights a pass reads at most
TURNS = 2  # turns per side
RUNS_PER_TURN = 2


@dataclass(frozen=True)
class ActivationMeasure:
    """One measurement: the seconds of each timed pass per side."""

    faithful_runs: tuple[float, ...]
    int8_runs: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """The faithful side's best pass over int8's."""
        return min(self.faithful_runs) / min(self.int8_runs)

    def merged(self, other: ActivationMeasure) -> ActivationMeasure:
        """Both measurements' runs, side by side."""
        return ActivationMeasure(self.faithful_runs + other.faithful_runs,
                                 self.int8_runs + other.int8_runs)

    def describe(self) -> str:
        return (f"one-row pass of the packed linears: float32 {min(self.faithful_runs) * 1e3:.2f}"
                f" ms, int8 {min(self.int8_runs) * 1e3:.2f} ms ({self.ratio:.2f}x)")


def decide(m: ActivationMeasure, margin: float) -> str | None:
    """``"float32"``, ``"int8"`` or None (no verdict), by the module docstring's rule."""
    f, q = _kept(m.faithful_runs), _kept(m.int8_runs)
    if max(f) <= (1 + margin) * min(q):
        return "float32"
    if min(f) > (1 + margin) * max(q):
        return "int8"
    return None


def sampled_parts(mods: list[nn.Module]) -> list[QuantLinear]:
    """The packed parts a pass calls: every ``QuantLinear`` of ``mods`` (a concatenation's
    parts), in order, up to :data:`SAMPLE_BYTES` of weights."""
    out, total = [], 0
    for mod in mods:
        for part in (mod.parts if isinstance(mod, QuantConcat) else [mod]):
            if not isinstance(part, QuantLinear) or part.is_q5:
                continue
            size = sum(t.numel() * t.element_size() for t in (part.qs, part.d, part.m)
                       if t is not None)
            if out and total + size > SAMPLE_BYTES:
                return out
            out.append(part)
            total += size
    return out


def confirmed(measure_once: Callable[[], ActivationMeasure], default: str,
               margin: float) -> tuple[ActivationMeasure, str | None]:
    """The measurement and its verdict (:func:`decide`), measuring again when the first verdict
    is not ``default``: the second measurement's runs join the first's and are decided
    together, so a verdict against the default needs both to separate the same way."""
    got = measure_once()
    verdict = decide(got, margin)
    if verdict is not None and verdict != default:
        got = got.merged(measure_once())
        verdict = decide(got, margin)
    return got, verdict


PassTimer = Callable[[list[QuantLinear], dict[int, torch.Tensor], int], list[float]]


def module_passes(parts: list[QuantLinear], xs: dict[int, torch.Tensor],
                  passes: int) -> list[float]:
    """Seconds of each of ``passes`` passes calling every part's module on its input (Python
    between the calls; engine/weight_prep/activation_measure.py times the decode stack's
    own linears instead)."""
    out = []
    with torch.inference_mode():
        for _ in range(passes):
            start = time.perf_counter()
            for p in parts:
                p(xs[p.in_features])
            out.append(time.perf_counter() - start)
    return out


def measure(parts: list[QuantLinear], invariant: bool = True,
            time_passes: PassTimer = module_passes) -> ActivationMeasure:
    """Time one-row passes over ``parts`` on both sides (module docstring) with
    ``time_passes``, starting from the int8 kernels they are on (``invariant``: a 4-bit
    weight's int8 side in the blocked layout, as batch invariance will serve it); the parts are
    left on the faithful float32 kernel (their ``kernels`` from before, passed back to
    ``set_kernels``, restore them exactly)."""
    xs = {p.in_features: torch.randn(1, p.in_features, generator=torch.Generator()
                                     .manual_seed(p.in_features)) for p in parts}
    if invariant:
        for p in parts:
            if p.is_q4:
                p.choose(q4_layout="blocked")
    as_loaded = [p.kernels for p in parts]
    runs: dict[str, list[float]] = {"int8": [], "float32": []}
    for turn in range(TURNS):
        if turn:
            for p, choice in zip(parts, as_loaded, strict=True):
                p.set_kernels(choice)
        runs["int8"] += time_passes(parts, xs, RUNS_PER_TURN + 1)[1:]  # the first only warms
        for p in parts:
            p.choose(activation="float32")
        runs["float32"] += time_passes(parts, xs, RUNS_PER_TURN + 1)[1:]
    return ActivationMeasure(tuple(runs["float32"]), tuple(runs["int8"]))
