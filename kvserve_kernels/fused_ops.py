"""Triton kernels for the decoder layer's element-wise steps on NVIDIA GPUs.

Each kernel is one pass over the activations where PyTorch runs residual add + RMSNorm and
SiLU x up as several kernels. (No fused RoPE: it disagreed with PyTorch's bf16 arithmetic by
an ulp and HF parity fell: docs/decisions.md#quality-figures-behind-defaults.)

Numerics follow HF's PyTorch arithmetic operation by operation, including where it rounds to the
model's dtype: the residual sum is rounded to the dtype before it is normalised; the norm is
taken in float32, rounded to the dtype, then scaled by the weight; SiLU rounds before the
multiply by ``up``. So in float32 the results equal ``engine.models.layer_ops.TorchLayerOps`` to
rounding, and in bf16/fp16 to the last bit except where PyTorch's own kernels differ in an ulp.

Triton's launcher costs more per launch than PyTorch's, so the model runner uses these for the
captured (CUDA-graph) decode steps only. Every function takes rows whose last dimension is
contiguous; other strides are free."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_res, stride_out,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # rounded like torch's add
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # torch's silu, then rounded
    tl.store(out_ptr + row * stride_out + cols,
             (s * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x)`` over the last dimension; a new tensor of ``x``'s shape."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, n, rows.stride(0),
                                           rows.stride(0), out.stride(0), eps,
                                           HAS_RESIDUAL=False,
                                           BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rms_norm(x + residual), x + residual)``; the sum is written into
    ``residual`` (``[T, hidden]``, rows contiguous), which is returned as the second value."""
    if residual.stride(-1) != 1 or residual.shape != x.shape:
        raise ValueError("residual must match x and be contiguous in its last dimension")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, n, x.stride(0),
                                        residual.stride(0), out.stride(0), eps,
                                        HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n))
    return out, residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[T, 2 * I]`` (gate first)."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    t, two_i = gate_up.shape
    n = two_i // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(n))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0),
                                                     out.stride(0), BLOCK=block)
    return out
