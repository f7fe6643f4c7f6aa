"""Linear layers on oneDNN with pre-packed weights, for the CPU path.

``F.linear`` on CPU goes to MKL's sgemm with the plain ``[out, in]`` weight, which re-lays the
weight out on every call. oneDNN (shipped inside PyTorch as "mkldnn") can keep the weight in its
own blocked layout, packed once at load time; on the development CPU (2 cores, AVX2) that is
1.2-2.3x faster for this model's shapes, and most at decode's small row counts (the 576 -> 49152
logits projection at 64 rows: ~45 -> ~100 GFLOP/s). Same math (a float32 GEMM with float32
accumulation); only the summation order differs, as between any two BLAS libraries.

``pack_linears(model)`` swaps every ``nn.Linear`` for a ``PackedLinear``. The model runner calls
it (through the model's ``pack_linears``) only when ``onednn_linear_available`` says yes: a CPU,
float32 or bfloat16, a PyTorch built with oneDNN, and not ``KVSERVE_ONEDNN_LINEAR=0``.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("kvserve.engine")


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when a packed oneDNN linear can run for ``dtype`` on ``device`` (checked by running
    a tiny one, so a PyTorch build without the op answers False instead of failing later)."""
    if os.environ.get("KVSERVE_ONEDNN_LINEAR", "1") == "0":
        return False
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 8, dtype=dtype)
        x = torch.ones(3, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, pack_weight(w), None, "none", [], "")
        return bool(torch.equal(out, F.linear(x, w)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered into oneDNN's layout for any number of input rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` through oneDNN with ``W`` packed once. Inputs are ``[rows, in]`` (or
    any ``[..., in]``, flattened); the output has ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_weight(weight), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                          requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, oneDNN packed"


def pack_linears(model: nn.Module) -> int:
    """Replace each ``nn.Linear`` under ``model`` by a ``PackedLinear`` (dense weights freed).
    Returns the number replaced. Call only where ``onednn_linear_available`` said yes."""
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod.weight, mod.bias))
    logger.debug("packed %d linear layers for oneDNN", len(targets))
    return len(targets)
