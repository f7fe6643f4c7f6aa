"""The decoder layer's element-wise steps, behind one small interface with two implementations.

``TorchLayerOps`` is HF's own arithmetic in PyTorch ops (any device, any dtype). ``FusedCpuOps``
runs the same math as single-pass C++ loops from ``engine.cpu_kernels`` (CPU, float32), where
PyTorch would stream the activations through memory once per op. ``layer_ops_for(device,
dtype)`` picks the fused set where it applies and its kernels build, else the PyTorch one.

Contract shared by both: ``x`` is ``[T, hidden]``; ``add_rms_norm(x, residual, ...)`` returns
``(rms_norm(x + residual), x + residual)`` and may reuse ``residual``'s storage for the sum (the
caller must not read the old residual afterwards); ``rotary(x, cos, sin)`` takes a ``[T, heads,
D]`` view (heads and D contiguous), may rotate it in place, and returns the rotated tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.rope import apply_rotary


class TorchLayerOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Same arithmetic as HF: normalise in fp32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos.unsqueeze(1), sin.unsqueeze(1))


class FusedCpuOps(TorchLayerOps):
    """The compiled single-pass versions (float32 on CPU only)."""

    name = "fused-cpu"

    def __init__(self, module) -> None:
        self._m = module

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._m.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._m.add_rms_norm_(x, residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._m.silu_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self._m.rotary_(x, cos, sin)
        return x


def layer_ops_for(device: torch.device, dtype: torch.dtype) -> TorchLayerOps:
    """The fused CPU ops for float32 on CPU when the kernels build, else PyTorch's."""
    if device.type == "cpu" and dtype == torch.float32:
        from engine.cpu_kernels import load

        module = load()
        if module is not None:
            return FusedCpuOps(module)
    return TorchLayerOps()
