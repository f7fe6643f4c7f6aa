"""Packed experts for a mixture-of-experts model (engine.models.moe_model), from a GGUF's
quantised expert tensors (``quantization=auto``) or quantised on load (``int4``/``int8``).

Contract of :func:`packed_experts`: for each sparse layer whose every expert has packed
gate, up and down weights in ``packed`` (keyed by ``expert_param_name``), a
:class:`~engine.models.moe.PackedExperts` under the attribute path ``layers.N.moe.experts``,
one gate/up linear per expert (gate and up rows concatenated, or a ``QuantConcat`` where their
formats differ) and one down linear. With ``check``, every expert's packed rows must
dequantise to the float weights already loaded (ValueError otherwise, as for the dense
linears). Layers missing any part keep their float experts. The model is not changed.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.moe import PackedExperts
from engine.models.moe_model import expert_param_name
from engine.quantization.formats import Packed, cat, same_layout
from engine.quantization.linear import QuantConcat, QuantLinear
from engine.quantization.rtn import quantise


@torch.no_grad()
def packed_experts(model: nn.Module, packed: dict[str, Packed],
                   check: bool = True) -> dict[str, PackedExperts]:
    """See the module contract."""
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else {}
    out: dict[str, PackedExperts] = {}
    for i, block in blocks.items():
        experts = block.experts
        names = [[expert_param_name(i, e, p) for p in ("gate_proj", "up_proj", "down_proj")]
                 for e in range(experts.num_experts)]
        if not all(n in packed for row in names for n in row):
            continue
        gate_up = [_gate_up(packed[g], packed[u]) for g, u, _ in names]
        down = [QuantLinear(packed[d]) for _, _, d in names]
        if check:
            for e in range(experts.num_experts):
                _check(gate_up[e], experts.gate_up_proj[e], f"layers.{i}.experts.{e}.gate_up")
                _check(down[e], experts.down_proj[e], f"layers.{i}.experts.{e}.down")
        out[f"layers.{i}.moe.experts"] = PackedExperts(gate_up, down)
    return out


@torch.no_grad()
def rtn_experts(model: nn.Module, scheme: str, group_size: int) -> dict[str, PackedExperts]:
    """Every sparse layer's float experts quantised to ``scheme`` (``quant_rtn.quantise``);
    layers whose widths do not split into ``group_size`` groups keep float experts."""
    blocks = model.moe_blocks() if hasattr(model, "moe_blocks") else {}
    out: dict[str, PackedExperts] = {}
    for i, block in blocks.items():
        experts = block.experts
        if (experts.gate_up_proj.shape[-1] % group_size
                or experts.down_proj.shape[-1] % group_size):
            continue
        gate_up = [QuantLinear(quantise(w, scheme, group_size)) for w in experts.gate_up_proj]
        down = [QuantLinear(quantise(w, scheme, group_size)) for w in experts.down_proj]
        out[f"layers.{i}.moe.experts"] = PackedExperts(gate_up, down)
    return out


def _gate_up(gate: Packed, up: Packed) -> QuantLinear | QuantConcat:
    """One linear over gate rows then up rows (a ``QuantConcat`` where their formats differ)."""
    if same_layout([gate, up]):
        return QuantLinear(cat([gate, up]))
    return QuantConcat([QuantLinear(gate), QuantLinear(up)])


def _check(q: QuantLinear | QuantConcat, weight: torch.Tensor, name: str) -> None:
    """The packed rows must dequantise to the float weight loaded from the converted
    checkpoint (the same GGUF blocks): only float rounding may differ."""
    got = q.dequantize_rows(torch.arange(q.out_features))
    want = weight.detach().float()
    tol = 1e-5 * float(want.abs().max()) + 1e-7
    if got.shape != want.shape or float((got - want).abs().max()) > tol:
        raise ValueError(f"packed expert weight {name} does not match its dequantised copy "
                         "(tensor mapping is wrong); use quantization='none'")
