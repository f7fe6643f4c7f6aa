"""The start-up probe behind ``quantization="auto"``: which row counts run on packed
quantised weights and which on the float modules they replace, and which dtype the packed
modules' dense (prefill) path multiplies in, all by timing this model's modules on this machine.

:func:`choose` first times the dense path with float32 and bfloat16 panels
(:func:`probe_panels`, at the largest probed row count above the kernels' ``DENSE_ROWS``) and
keeps the faster, then times a pass over every replaced linear, float against quantised, at each
of ``PROBE_ROWS`` (decode of 1..64 sequences, and a prefill chunk) (:func:`probe`): the
quantised path keeps the smallest counts it wins, contiguously from one row (a
:class:`Verdict`: ``quant``, ``hybrid`` or ``float``). Measurements whose runs disagree (a busy
machine) are taken again. ``engine.models.quant_apply`` caches and applies the verdict.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.quant_linear import DENSE_ROWS, QuantisedModules


@dataclass
class ProbeResult:
    """Seconds of one pass over all linears (and the logits head) on each path: the best of
    the timed runs (``float_runs`` / ``quant_runs``, all of them)."""

    float_s: float
    quant_s: float
    float_runs: tuple[float, ...] = ()
    quant_runs: tuple[float, ...] = ()

    @property
    def use_quantised(self) -> bool:
        return self.quant_s < self.float_s

    @property
    def confirmed(self) -> bool:
        """Each side's best run has a second run within 25% of it: the best is the machine's
        speed, not a lucky or an unlucky moment (another busy process stalls every run)."""
        return all(len(runs) >= 2 and sorted(runs)[1] <= 1.25 * min(runs)
                   for runs in (self.float_runs, self.quant_runs))

    def merged(self, other: ProbeResult) -> ProbeResult:
        """Both measurements' runs together (a result without runs counts as one run)."""
        f = (self.float_runs or (self.float_s,)) + (other.float_runs or (other.float_s,))
        q = (self.quant_runs or (self.quant_s,)) + (other.quant_runs or (other.quant_s,))
        return ProbeResult(min(f), min(q), f, q)


PROBE_ROWS = (1, 4, 16, 64, 256)
MAX_PROBE_ATTEMPTS = 4


@dataclass
class Verdict:
    """Which path serves which row counts: ``mode`` is ``quant`` (every size), ``hybrid``
    (quantised up to ``float_above`` rows, float beyond) or ``float``; ``probes`` maps each
    probed row count to its measurement."""

    mode: str
    float_above: int | None
    probes: dict[int, ProbeResult]
    panel_dtype: str = "float32"
    panel_probe: ProbeResult | None = None

    def describe(self) -> str:
        text = "; ".join(f"{rows} rows: quantised {r.quant_s * 1e3:.2f} ms, float "
                         f"{r.float_s * 1e3:.2f} ms" for rows, r in self.probes.items())
        if self.panel_probe is not None:
            r = self.panel_probe
            text += (f"; prefill panels {self.panel_dtype} (float32 {r.float_s * 1e3:.2f} ms, "
                     f"bfloat16 {r.quant_s * 1e3:.2f} ms)")
        return text

    @property
    def confirmed(self) -> bool:
        extra = [] if self.panel_probe is None else [self.panel_probe]
        return all(r.confirmed for r in [*self.probes.values(), *extra])

    def to_dict(self) -> dict:
        d = {"mode": self.mode, "float_above": self.float_above, "panel_dtype": self.panel_dtype,
             "probes": {str(n): [r.float_s, r.quant_s] for n, r in self.probes.items()}}
        if self.panel_probe is not None:
            d["panel_probe"] = [self.panel_probe.float_s, self.panel_probe.quant_s]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        if d["mode"] not in ("quant", "hybrid", "float"):
            raise ValueError(f"unknown verdict mode {d['mode']!r}")
        panel = d.get("panel_dtype", "float32")
        if panel not in ("float32", "bfloat16"):
            raise ValueError(f"unknown panel dtype {panel!r}")
        probes = {int(n): ProbeResult(f, q) for n, (f, q) in d["probes"].items()}
        pp = d.get("panel_probe")
        return cls(d["mode"], d["float_above"], probes, panel,
                   None if pp is None else ProbeResult(*pp))


@torch.no_grad()
def choose(model: nn.Module, q: QuantisedModules, rows: tuple[int, ...] = PROBE_ROWS,
           force: bool = False) -> Verdict:
    """First the dense path's panel dtype: where row counts above the kernels' ``dense_rows``
    are probed, their largest is timed with float32 and bfloat16 panels (:func:`probe_panels`)
    and the faster kept. Then each row count in increasing order, float against quantised; the
    quantised path keeps the smallest counts it wins, contiguously from 1 row. A measurement
    whose runs disagree (:attr:`ProbeResult.confirmed`: the machine is busy) is taken again, up
    to ``MAX_PROBE_ATTEMPTS`` times. ``force``: measure, but use the quantised path for all."""
    panel_dtype, panel_probe = "float32", None
    dense = [n for n in rows if n > DENSE_ROWS]
    if dense:
        panel_probe = confirmed_probe(lambda repeats: probe_panels(q, max(dense), repeats), 2)
        if panel_probe.use_quantised:
            panel_dtype = "bfloat16"
    set_panel_dtype(q, panel_dtype)
    probes: dict[int, ProbeResult] = {}
    wins_up_to = 0
    for n in sorted(rows):
        probes[n] = confirmed_probe(lambda repeats, n=n: probe(model, q, rows=n, repeats=repeats),
                               3 if n <= 16 else 2)
        if wins_up_to == len(probes) - 1 and probes[n].use_quantised:
            wins_up_to = len(probes)
    ordered = sorted(probes)
    if force or wins_up_to == len(ordered):
        return Verdict("quant", None, probes, panel_dtype, panel_probe)
    if wins_up_to == 0:
        return Verdict("float", None, probes, panel_dtype, panel_probe)
    return Verdict("hybrid", ordered[wins_up_to - 1], probes, panel_dtype, panel_probe)


def confirmed_probe(measure, repeats: int) -> ProbeResult:
    """``measure(repeats)``, merged with further measurements (3 repeats each) until its runs
    agree or ``MAX_PROBE_ATTEMPTS`` measurements were taken."""
    result = measure(repeats)
    for _ in range(MAX_PROBE_ATTEMPTS - 1):
        if result.confirmed:
            break
        result = result.merged(measure(3))
    return result


def set_panel_dtype(q: QuantisedModules, dtype: str | torch.dtype) -> None:
    """Every quantised module's dense-path panel dtype (``"float32"`` / ``"bfloat16"``)."""
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    for m in [*q.linears.values(), *([q.embedding.head] if q.embedding else [])]:
        m.set_panel_dtype(dt)



def float_modules(model: nn.Module, q: QuantisedModules) -> list[tuple[nn.Module, nn.Module]]:
    pairs = [(model.get_submodule(path), mod) for path, mod in q.linears.items()]
    if q.embedding is not None and model.lm_head is None:
        dense_head = model.tied_head
        pairs.append((dense_head if dense_head is not None else _TiedHead(model), q.embedding.head))
    return pairs


class _TiedHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.weight = model.embed_tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def _inputs(modules: list[nn.Module], rows: int) -> dict[int, torch.Tensor]:
    widths = {m.in_features if hasattr(m, "in_features") else m.weight.shape[1] for m in modules}
    return {k: torch.randn(rows, k) for k in widths}


def _alternate(passes: tuple, repeats: int) -> ProbeResult:
    """Time the two zero-argument ``passes`` alternately, ``repeats`` times each after one
    warm-up each; ``float_s`` is the first's best run, ``quant_s`` the second's."""

    def timed(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    for run in passes:
        run()
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for side in (0, 1):
            runs[side].append(timed(passes[side]))
    return ProbeResult(min(runs[0]), min(runs[1]), tuple(runs[0]), tuple(runs[1]))


@torch.no_grad()
def probe(model: nn.Module, q: QuantisedModules, rows: int = 1, repeats: int = 5) -> ProbeResult:
    """Time a ``rows``-row pass over every replaced linear, float then quantised, alternated
    ``repeats`` times (best pass of each kept). Each pass touches every weight once, as a decode
    step does, so the weights come from memory, not cache."""
    pairs = float_modules(model, q)
    inputs = _inputs([m for pair in pairs for m in pair], rows)

    def side(i: int):
        return lambda: [pair[i](inputs[pair[1].in_features]) for pair in pairs]

    return _alternate((side(0), side(1)), repeats)


@torch.no_grad()
def probe_panels(q: QuantisedModules, rows: int, repeats: int = 3) -> ProbeResult:
    """Time a ``rows``-row pass over the layers' quantised projections on their dense (prefill)
    path with float32 panels (``float_s``) and with bfloat16 panels (``quant_s``), alternated
    (the logits head is left out: prefill runs it on a few rows only). The modules are left
    with float32 panels."""
    mods = [m for path, m in q.linears.items() if path.startswith("layers.")]
    inputs = _inputs(mods, rows)

    def side(dtype: torch.dtype):
        def run() -> None:
            for m in mods:
                m.set_panel_dtype(dtype)
                m(inputs[m.in_features])
        return run

    try:
        return _alternate((side(torch.float32), side(torch.bfloat16)), repeats)
    finally:
        for m in mods:
            m.set_panel_dtype(torch.float32)
