"""A mixture-of-experts feed-forward block: a router picks ``top_k`` experts per token, each
expert is a SiLU-gated MLP, and a token's output is the routing-weighted sum of its experts'.

:func:`route` is HF's arithmetic (``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter``): softmax of
the router logits in float32, ``torch.topk`` (HF's ties and order), with ``normalise`` the kept
probabilities divided by their sum; float32 weights ``[T, k]`` and expert ids ``[T, k]``. An
experts module (:class:`MoeExperts`, float stacked weights, or :class:`PackedExperts`, one
packed linear per expert) maps ``(x [T, H], weights, ids)`` to ``[T, H]`` = the sum over a
token's experts of ``weight * down(silu(gate(x)) * up(x))``, in ascending expert order as HF.
``MoeExperts.path``: ``"grouped"`` (:func:`grouped_moe`: only the routed rows, sorted by expert,
one gate/up and one down matmul per expert; a host sync, so not capturable), ``"fused"``
(``kvserve_kernels.fused_moe``: the same grouping as two Triton GEMMs, no host sync, capturable;
on a CPU only under ``TRITON_INTERPRET=1``), ``"dense"`` (:meth:`MoeExperts.dense`: every expert
on every token, ``E / k`` times the FLOPs but fixed shapes; while capturing without Triton, or
on request), or ``"auto"`` (default: fused on a CUDA device where Triton imports, else grouped)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layer_ops import TorchLayerOps
from engine.models.moe_spec import MoeSpec

_TORCH_OPS = TorchLayerOps()


def _has_triton() -> bool:
    from kvserve_kernels import HAS_TRITON

    return HAS_TRITON


def route(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 routing weights ``[T, k]``, expert ids ``[T, k]``); see the module contract."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                gate_up: Callable[[int, torch.Tensor], torch.Tensor],
                down: Callable[[int, torch.Tensor], torch.Tensor],
                ops: TorchLayerOps = _TORCH_OPS) -> torch.Tensor:
    """The routed rows only: ``gate_up(e, rows)`` and ``down(e, rows)`` are expert ``e``'s two
    projections, called once per expert that has tokens (see the module contract)."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync
    tokens = order // k
    w_sorted = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        h = down(e, ops.silu_mul(gate_up(e, x[rows])))
        out.index_add_(0, rows, (h * w_sorted[start:start + n, None]).to(x.dtype))
        start += n
    return out


class MoeExperts(nn.Module):
    """Float experts stacked as HF stores them: ``gate_up_proj [E, 2I, H]`` (gate rows first,
    then up) and ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.path = "auto"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                ops: TorchLayerOps = _TORCH_OPS) -> torch.Tensor:
        path = self.path
        if path == "auto":
            path = "fused" if x.is_cuda and _has_triton() else "grouped"
        if path == "fused":
            from kvserve_kernels.fused_moe import fused_moe

            return fused_moe(x, weights, ids, self.gate_up_proj, self.down_proj, ops.silu_mul)
        if path == "dense" or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.dense(x, weights, ids, ops)
        return grouped_moe(x, weights, ids, self.num_experts,
                           lambda e, r: F.linear(r, self.gate_up_proj[e]),
                           lambda e, r: F.linear(r, self.down_proj[e]), ops)

    def dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              ops: TorchLayerOps = _TORCH_OPS) -> torch.Tensor:
        """Every expert on every token (fixed shapes; see the module contract)."""
        e, t = self.num_experts, x.shape[0]
        combine = torch.zeros(t, e, dtype=torch.float32, device=x.device)
        combine.scatter_(1, ids, weights)
        gu = torch.bmm(x.unsqueeze(0).expand(e, t, x.shape[1]),
                       self.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
        h = ops.silu_mul(gu.reshape(e * t, -1)).view(e, t, self.intermediate)
        y = torch.bmm(h, self.down_proj.transpose(1, 2))  # [E, T, H]
        return (y.float() * combine.t().unsqueeze(-1)).sum(0).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.down_proj.shape[1]}, "
                f"intermediate={self.intermediate}, path={self.path}")


class PackedExperts(nn.Module):
    """Experts over packed weights: one gate/up and one down ``QuantLinear`` (or
    ``QuantConcat``) per expert; always the grouped path (CPU, float32 activations), so only
    the routed experts' packed rows are read."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError("packed experts need one gate/up and one down linear per expert")
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.num_experts = len(gate_up)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                ops: TorchLayerOps = _TORCH_OPS) -> torch.Tensor:
        return grouped_moe(x, weights, ids, self.num_experts,
                           lambda e, r: self.gate_up[e](r), lambda e, r: self.down[e](r), ops)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in (*self.gate_up, *self.down))


class Router(nn.Module):
    """The router's ``[E, H]`` weight, applied with ``F.linear`` (kept out of the packed
    linears so that the logits, and so the expert choice, round as HF's do)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoeBlock(nn.Module):
    """Router plus experts: ``[T, H]`` in, ``[T, H]`` out. ``last_ids`` keeps the latest
    routing (expert ids ``[T, k]``) when ``record`` is set, for tests that compare it."""

    def __init__(self, spec: MoeSpec, hidden: int) -> None:
        super().__init__()
        self.top_k, self.normalise = spec.top_k, spec.norm_topk_prob
        self.gate = Router(spec.num_experts, hidden)
        self.experts: nn.Module = MoeExperts(spec.num_experts, hidden, spec.expert_intermediate)
        self.record = False
        self.last_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, ops: TorchLayerOps = _TORCH_OPS) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.normalise)
        if self.record:
            self.last_ids = ids.clone()
        return self.experts(x, weights, ids, ops)
