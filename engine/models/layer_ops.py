"""The decoder layer's element-wise steps, behind one small interface with two implementations.

``TorchLayerOps`` is HF's own arithmetic in PyTorch ops (any device, any dtype). ``FusedCpuOps``
runs the same math as single-pass C++ loops from ``engine.cpu.kernels`` (CPU, float32), where
PyTorch would stream the activations through memory once per op. ``layer_ops_for(device,
dtype)`` picks the fused set where it applies and its kernels build, else the PyTorch one.

Contract shared by both: ``x`` is ``[T, hidden]``; ``add_rms_norm(x, residual, ...)`` returns
``(rms_norm(x + residual), x + residual)`` and may reuse ``residual``'s storage for the sum (the
caller must not read the old residual afterwards); ``rotary(x, cos, sin)`` takes a ``[T, heads,
D]`` view (heads and D contiguous), may rotate it in place, and returns the rotated tensor.
"""

from __future__ import annotations

import logging

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
    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma's MLP): ``gelu_tanh(gate) * up`` over the fused ``[gate | up]``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

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

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._m.gelu_tanh_mul(gate_up)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self._m.rotary_(x, cos, sin)
        return x


class TritonLayerOps(TorchLayerOps):
    """One Triton kernel per norm and per SiLU x up (``kvserve_kernels.fused_ops``), for CUDA graphs;
    RoPE stays PyTorch's (see kvserve_kernels/fused_ops.py)."""

    name = "triton"

    def __init__(self) -> None:
        from kvserve_kernels import fused_ops

        self._k = fused_ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._k.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._k.silu_mul(gate_up)


def check_against_torch(ops: TorchLayerOps, device: torch.device, dtype: torch.dtype,
                        hidden: int = 256) -> str | None:
    """Run ``ops`` once on small random inputs and compare with ``TorchLayerOps``; the reason
    they cannot be used (an exception, or results that differ beyond rounding), else None."""
    ref = TorchLayerOps()
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # float32: rounding; 16-bit: an ulp at these magnitudes (this catches broken kernels, the
    # tests check the arithmetic itself).
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (0.25, 0.02)
    try:
        x, res, w = rand(5, hidden), rand(5, hidden), rand(hidden)
        checks = [(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))]
        got_n, got_s = ops.add_rms_norm(x, res.clone(), w, 1e-6)
        exp_n, exp_s = ref.add_rms_norm(x, res.clone(), w, 1e-6)
        checks += [(got_n, exp_n), (got_s, exp_s)]
        gu = rand(5, 2 * hidden)
        checks.append((ops.silu_mul(gu), ref.silu_mul(gu)))
        checks.append((ops.gelu_tanh_mul(gu), ref.gelu_tanh_mul(gu)))
        for got, exp in checks:
            torch.testing.assert_close(got.float(), exp.float(), atol=atol, rtol=rtol)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the PyTorch ops
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    return None


def layer_ops_for(device: torch.device, dtype: torch.dtype) -> TorchLayerOps:
    """The fused CPU ops for float32 on CPU when the kernels build, else PyTorch's."""
    if device.type == "cpu" and dtype == torch.float32:
        from engine.cpu.kernels import load

        module = load()
        if module is not None:
            return FusedCpuOps(module)
    return TorchLayerOps()


def graph_layer_ops(device: torch.device, dtype: torch.dtype) -> TorchLayerOps | None:
    """The Triton layer ops for captured CUDA-graph steps when they pass
    :func:`check_against_torch` on ``device``; None (with a warning) when they do not."""
    try:
        ops: TorchLayerOps = TritonLayerOps()
    except Exception as exc:  # noqa: BLE001 - triton missing or broken
        reason: str | None = f"{type(exc).__name__}: {exc}"
    else:
        reason = check_against_torch(ops, device, dtype)
    if reason is None:
        return ops
    logging.getLogger("kvserve.engine").warning(
        "fused Triton layer ops unusable on %s (%s): CUDA graphs use PyTorch ops", device, reason)
    return None
