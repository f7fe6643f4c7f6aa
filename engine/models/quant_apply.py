"""Put packed quantised weights into a loaded Llama-family model, if they measure faster.

Three steps, called by the model runner for ``quantization="auto"``:

1. :func:`build_quantised` (before the float linears are packed): one ``QuantLinear`` per
   projection whose checkpoint tensors are all packed in one format (Q/K/V and gate/up stay
   fused: their packed rows are concatenated), a ``QuantEmbedding`` for the token table (the
   tied logits head reads the same data). Each packed weight is checked against the float
   weight already loaded from the converted checkpoint; a mismatch (a name or row-order error)
   raises ``ValueError`` instead of serving wrong weights.
2. :func:`choose` (after float packing): :func:`probe` times a pass over every linear, the float
   modules against the quantised ones, at ``PROBE_ROWS`` rows (decode of 1..64 sequences, and a
   prefill chunk), on this machine and these shapes. The quantised path is used for the row
   counts where it measured faster, never by a rule: for all of them (``quant``, the float
   copies are dropped), up to a crossover (``hybrid``: the float modules are kept for larger
   inputs), or for none (``float``).
3. :func:`apply` swaps the modules in (with their float fallbacks in ``hybrid``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.loading.gguf_quant import gguf_source, read_packed
from engine.models.quant_formats import Packed, cat
from engine.models.quant_linear import QuantEmbedding, QuantLinear, quant_kernels

logger = logging.getLogger("kvserve.engine")

_FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "o_proj": ("self_attn.o_proj",), "down_proj": ("mlp.down_proj",)}


@dataclass
class QuantisedModules:
    """Replacement modules by attribute path (``layers.3.qkv_proj``, ``lm_head``), and the
    embedding (None when the token table is not packed)."""

    linears: dict[str, QuantLinear] = field(default_factory=dict)
    embedding: QuantEmbedding | None = None

    @property
    def nbytes(self) -> int:
        mods = [*self.linears.values(), *([self.embedding.head] if self.embedding else [])]
        return sum(m.nbytes for m in mods)


@dataclass
class ProbeResult:
    """Seconds of one 1-row pass over all linears (and the logits head) on each path."""

    float_s: float
    quant_s: float

    @property
    def use_quantised(self) -> bool:
        return self.quant_s < self.float_s


PROBE_ROWS = (1, 4, 16, 64, 256)


@dataclass
class Verdict:
    """Which path serves which row counts: ``mode`` is ``quant`` (every size), ``hybrid``
    (quantised up to ``float_above`` rows, float beyond) or ``float``; ``probes`` maps each
    probed row count to its measurement."""

    mode: str
    float_above: int | None
    probes: dict[int, ProbeResult]

    def describe(self) -> str:
        return "; ".join(f"{rows} rows: quantised {r.quant_s * 1e3:.2f} ms, float "
                         f"{r.float_s * 1e3:.2f} ms" for rows, r in self.probes.items())


@torch.no_grad()
def choose(model: nn.Module, q: QuantisedModules, rows: tuple[int, ...] = PROBE_ROWS,
           force: bool = False) -> Verdict:
    """Probe each row count in increasing order; the quantised path keeps the smallest counts
    it wins, contiguously from 1 row. ``force``: measure, but use the quantised path for all."""
    probes: dict[int, ProbeResult] = {}
    wins_up_to = 0
    for n in sorted(rows):
        probes[n] = probe(model, q, rows=n, repeats=3 if n <= 16 else 1)
        if wins_up_to == len(probes) - 1 and probes[n].use_quantised:
            wins_up_to = len(probes)
    ordered = sorted(probes)
    if force or wins_up_to == len(ordered):
        return Verdict("quant", None, probes)
    if wins_up_to == 0:
        return Verdict("float", None, probes)
    return Verdict("hybrid", ordered[wins_up_to - 1], probes)


@torch.no_grad()
def build_quantised(model: nn.Module, packed: dict[str, Packed]) -> QuantisedModules:
    """Quantised replacements for ``model``'s float ``nn.Linear``/``nn.Embedding`` modules
    (still in place, weights loaded). Does not change ``model``."""
    out = QuantisedModules()
    for i, layer in enumerate(model.layers):
        for attr, sources in _FUSED.items():
            parts = [packed.get(f"model.layers.{i}.{s}.weight") for s in sources]
            if any(p is None for p in parts) or len({type(p) for p in parts}) != 1:
                continue  # not all packed, or mixed formats: this projection stays float
            dense = getattr(layer, attr)
            q = QuantLinear(cat(parts), dense.bias)
            _check(q, dense.weight, f"layers.{i}.{attr}")
            out.linears[f"layers.{i}.{attr}"] = q
    table = packed.get("model.embed_tokens.weight")
    if table is not None:
        out.embedding = QuantEmbedding(table)
        _check(out.embedding.head, model.embed_tokens.weight, "embed_tokens")
    head = packed.get("lm_head.weight")
    if head is not None and model.lm_head is not None:
        out.linears["lm_head"] = QuantLinear(head)
        _check(out.linears["lm_head"], model.lm_head.weight, "lm_head")
    return out


def _check(q: QuantLinear, weight: torch.Tensor, name: str) -> None:
    """The packed weight must dequantise to the float one loaded from the converted checkpoint
    (same source blocks, dequantised by transformers' reader): only float rounding may differ."""
    ref = weight.detach().float()
    rows = torch.arange(q.out_features)
    for start in range(0, q.out_features, 4096):  # bounded temporaries for big tables
        got = q.dequantize_rows(rows[start:start + 4096])
        want = ref[start:start + 4096]
        tol = 1e-5 * float(want.abs().max()) + 1e-7
        if got.shape != want.shape or float((got - want).abs().max()) > tol:
            raise ValueError(f"packed weight {name} does not match its dequantised copy "
                             "(row order or tensor mapping is wrong); use quantization='none'")


def _float_modules(model: nn.Module, q: QuantisedModules) -> list[tuple[nn.Module, nn.Module]]:
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


@torch.no_grad()
def probe(model: nn.Module, q: QuantisedModules, rows: int = 1, repeats: int = 5) -> ProbeResult:
    """Time a ``rows``-row pass over every replaced linear, float then quantised, alternated
    ``repeats`` times (best pass of each kept). Each pass touches every weight once, as a decode
    step does, so the weights come from memory, not cache."""
    pairs = _float_modules(model, q)
    xs = {m.in_features if hasattr(m, "in_features") else m.weight.shape[1] for _, m in pairs}
    xs |= {qm.in_features for _, qm in pairs}
    inputs = {k: torch.randn(rows, k) for k in xs}

    def run(side: int) -> float:
        start = time.perf_counter()
        for pair in pairs:
            mod = pair[side]
            mod(inputs[pair[1].in_features])
        return time.perf_counter() - start

    run(0)
    run(1)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for side in (0, 1):
            best[side] = min(best[side], run(side))
    return ProbeResult(float_s=best[0], quant_s=best[1])


def apply(model: nn.Module, q: QuantisedModules, float_above: int | None = None) -> int:
    """Swap the quantised modules into ``model``; returns how many modules were replaced. With
    ``float_above``, each keeps the float module it replaces for inputs of more rows."""
    if float_above is not None:
        for dense, quant in _float_modules(model, q):
            quant.keep_float_above(float_above, dense)
    for path, mod in q.linears.items():
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, mod)
    n = len(q.linears)
    if q.embedding is not None:
        model.embed_tokens = q.embedding
        if model.lm_head is None:
            model.tied_head = q.embedding.head
        n += 1
    return n


def packed_replacements(model: nn.Module, config, device: torch.device, dtype: torch.dtype,
                        files_dir: Path | None) -> QuantisedModules | None:
    """Step 1 for an engine: packed replacements for ``model``'s float modules, or None when
    the path does not apply (quantization none, dummy weights, not a GGUF, not float32 on CPU,
    no CPU kernels)."""
    if (config.quantization != "auto" or config.load_format == "dummy" or files_dir is None
            or device.type != "cpu" or dtype != torch.float32 or quant_kernels() is None):
        return None
    source = gguf_source(files_dir)
    if source is None:
        return None
    packed = read_packed(source)
    return build_quantised(model, packed) if packed else None


def adopt_if_faster(model: nn.Module, quantised: QuantisedModules) -> Verdict:
    """Steps 2 and 3 for an engine: swap the packed modules in for the row counts where the
    probe measured them faster (:func:`choose`), keeping the float modules for larger inputs
    when they lose there; log the verdict with its figures. ``KVSERVE_QUANT_FORCE=1`` uses the
    packed weights for every size whatever the probe says (tests)."""
    force = os.environ.get("KVSERVE_QUANT_FORCE", "0") == "1"
    verdict = choose(model, quantised, force=force)
    if verdict.mode == "float":
        logger.info("quantization=auto: keeping float weights, the quantised kernels are "
                    "slower on this machine (%s)", verdict.describe())
        return verdict
    n = apply(model, quantised, verdict.float_above)
    scope = ("every batch size" if verdict.float_above is None else
             f"up to {verdict.float_above} rows, float weights kept above (measured slower "
             "quantised there)")
    logger.info("quantization=auto: %d modules on packed weights for %s (%s)", n, scope,
                verdict.describe())
    return verdict
