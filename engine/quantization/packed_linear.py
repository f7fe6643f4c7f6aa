"""Linear layers with weights re-laid out once at load time, for the CPU path.

``F.linear`` on CPU re-lays the plain ``[out, in]`` weight out on every call, tuned for large row
counts, while a decode step has as many rows as running sequences. Two packed backends, chosen
by ``linear_backend(device, dtype)``: ``"onednn"`` (float32 or bfloat16, oneDNN's own packed
layout) and ``"avx2-panels"`` (float32, x86 with AVX2+FMA: ``engine/cpu/csrc/small_gemm_cpu.cpp``
over 16-column weight panels; faster at decode row counts, slower on long prefills:
docs/decisions.md#packed-float-linears); ``"hybrid"`` (the default where both run) holds both
packings, the panel kernel up to ``SMALL_ROWS`` rows and oneDNN above, while the model's linear
weights are at most ``HYBRID_MAX_BYTES`` (beyond, ``"avx2-panels"``).

Both are ``F.linear``'s math (float32 accumulation), summed in another order.
``KVSERVE_PACKED_LINEAR=0`` turns packing off, ``=onednn`` skips the AVX2 kernel. Batch-invariant
(:meth:`PackedLinear.set_batch_invariant`): the panel kernel for every row count; oneDNN, whose
blocking follows the row count, is not used (without the panel kernel there is no such route)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import envs

_PANEL = 16
SMALL_ROWS = 128
HYBRID_MAX_BYTES = 2 * 1024**3


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when a packed oneDNN linear can run for ``dtype`` on ``device`` (checked by running
    a tiny one, so a PyTorch build without the op answers False instead of failing later)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 8, dtype=dtype)
        x = torch.ones(3, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, pack_onednn(w), None, "none", [], "")
        return bool(torch.equal(out, F.linear(x, w)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def panel_kernels_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when the AVX2 panel kernel runs here (float32 on an AVX2+FMA CPU, kernels built)."""
    return _panel_kernels(device, dtype) is not None


def _panel_kernels(device: torch.device, dtype: torch.dtype):
    if device.type != "cpu" or dtype != torch.float32:
        return None
    from engine.cpu.kernels import load

    module = load()
    return module if module is not None and module.small_gemm_supported() else None


def linear_backend(device: torch.device, dtype: torch.dtype,
                   linear_bytes: int = 0) -> str | None:
    """``"hybrid"``, ``"avx2-panels"``, ``"onednn"`` or None (plain ``nn.Linear``) for this
    device and dtype; ``linear_bytes`` (the model's linear weights) bounds the hybrid's copy.
    ``KVSERVE_PACKED_LINEAR`` (0 | onednn | avx2-panels | hybrid) overrides the choice."""
    choice = envs.packed_linear_choice()
    if choice == "0":
        return None
    panels = panel_kernels_available(device, dtype)
    onednn = onednn_linear_available(device, dtype)
    if choice in ("onednn", "avx2-panels", "hybrid"):
        ok = {"onednn": onednn, "avx2-panels": panels, "hybrid": panels and onednn}[choice]
        return choice if ok else None
    if panels and onednn and linear_bytes <= HYBRID_MAX_BYTES:
        return "hybrid"
    if panels:
        return "avx2-panels"
    return "onednn" if onednn else None


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's layout for any number of input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed once for ``backend``. Inputs are ``[..., in]``;
    the output has ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if backend not in ("avx2-panels", "onednn", "hybrid"):
            raise ValueError(f"unknown packed-linear backend {backend!r}")
        self.backend = backend
        self._kernels = None
        self.panels = self.panel_bias = self.onednn = self.bias = None
        b = None if bias is None else bias.detach().clone()
        if backend in ("avx2-panels", "hybrid"):
            self._kernels = _panel_kernels(weight.device, weight.dtype)
            self.panels = self._kernels.small_gemm_pack(weight.detach().contiguous())
            if b is not None:  # zero-padded to the panels' width, once
                self.panel_bias = F.pad(b, (0, self.panels.shape[0] * _PANEL - len(b)))
        if backend in ("onednn", "hybrid"):
            self.onednn = pack_onednn(weight)
            self.bias = b
        # Rows up to which the panel kernel runs (all rows without oneDNN, none without panels).
        self.small_rows = {"avx2-panels": 1 << 62, "hybrid": SMALL_ROWS, "onednn": -1}[backend]

    def set_batch_invariant(self) -> bool:
        """Run every row count on the panel kernel (row ``r``'s output then does not depend on
        the other rows); False, and nothing changed, where this linear has no panels."""
        if self.panels is None:
            return False
        self.small_rows = 1 << 62
        self.onednn = None  # never used again: free its copy of the weight
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.small_rows:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            out = self._kernels.small_gemm(x2, self.panels, self.out_features, self.panel_bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.onednn, self.bias,
                                                     "none", [], "")
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.backend}"


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of the ``nn.Linear`` layers under ``model``."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, nn.Linear))


def pack_linears(model: nn.Module, backend: str) -> int:
    """Replace each ``nn.Linear`` under ``model`` by a ``PackedLinear`` (dense weights freed).
    Returns the number replaced. ``backend`` comes from ``linear_backend``."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod.weight, mod.bias, backend))
    return len(targets)
