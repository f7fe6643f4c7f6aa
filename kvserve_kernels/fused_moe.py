"""A mixture-of-experts feed-forward as two grouped GEMMs (Triton, NVIDIA GPUs), no host sync.

Unlike ``engine.models.moe``'s grouped path (a host sync and a Python loop over experts), this
is capturable in a CUDA graph, as llama.cpp's ``mul_mat_id`` and vLLM's fused MoE:
:func:`align_by_expert` sorts the ``T * k`` (token, expert) pairs by expert (stable), pads each
expert's run to ``block_m`` with the sentinel ``T * k`` (device ops, shapes from ``T``, ``k``,
``E``, ``block_m`` only); ``_moe_gemm_kernel`` multiplies each ``block_m`` rows of one expert by
its ``[N, K]`` weight (optionally scaled by the routing weight) into each pair's own row;
:func:`fused_moe` runs gate/up, ``act``, down, then sums each token's ``k`` rows.
Numerics are HF's (``Qwen3MoeExperts`` / ``MixtralExperts``) step by step: products accumulated
in float32 and rounded to the dtype; the down output rounded, times the float32 routing weight,
rounded again; the sum in ascending expert order. float32 dots are IEEE, not TF32. So float32
equals the per-expert loop to rounding, bf16 to an ulp. Weights as HF stacks them:
``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]``; tiles (:func:`moe_tiles`): vLLM's defaults."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, pairs_ptr, block_expert_ptr, total_ptr,
                     num_pairs, n, k, a_div, stride_am, stride_be, stride_bn, stride_bk,
                     stride_cm, HAS_WEIGHTS: tl.constexpr, DOT_F32: tl.constexpr,
                     PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n, BLOCK_N)
    block_m = pid // n_blocks
    block_n = pid % n_blocks
    if block_m * BLOCK_M >= tl.load(total_ptr):
        return
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + block_m).to(tl.int64)
    a_row = (pair // a_div).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = (b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
              + offs_k[:, None] * stride_bk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = offs_k < k - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    out = acc.to(c_ptr.dtype.element_ty)
    if HAS_WEIGHTS:
        w = tl.load(w_ptr + pair, mask=valid, other=0.0)
        out = (out.to(tl.float32) * w[:, None]).to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, out, mask=valid[:, None] & col_ok[None, :])


def moe_tiles(num_pairs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows an expert's tile while the pairs are few (decode),
    64 beyond (vLLM's defaults before tuning)."""
    return (16, 64, 64) if num_pairs <= 256 else (64, 64, 32)


def align_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pairs, block_expert, total)`` for expert ids ``[T, k]`` (module contract, step 1):
    ``pairs[i]`` the flat (token, slot) index ``t * k + j`` of row ``i`` (``T * k`` in the
    padding), ``block_expert[b]`` the expert of rows ``b * block_m ...`` (clamped to the last
    expert past ``total``), ``total`` a one-element tensor: the rows in use, a multiple of
    ``block_m``."""
    flat = ids.reshape(-1).long()
    p, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(p, device=device) - (counts.cumsum(0) - counts)[expert]
    capacity = min(p + num_experts * (block_m - 1), p * block_m)
    capacity = triton.cdiv(capacity, block_m) * block_m
    pairs = torch.full((capacity,), p, dtype=torch.int32, device=device)
    pairs.scatter_(0, (ends - padded)[expert] + rank, order.to(torch.int32))
    starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, aligned: tuple, a_div: int,
          tiles: tuple[int, int, int], weights: torch.Tensor | None = None) -> None:
    pairs, block_expert, total = aligned
    block_m, block_n, block_k = tiles
    n, k = w.shape[1], w.shape[2]
    grid = (pairs.numel() // block_m * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, pairs, block_expert, total,
        out.shape[0], n, k, a_div, a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), HAS_WEIGHTS=weights is not None,
        DOT_F32=a.dtype == torch.bfloat16 and not a.is_cuda,
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              w_gate_up: torch.Tensor, w_down: torch.Tensor,
              act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``[T, H]``: each token's sum over its experts of ``weight * down(act(gate_up(x)))``
    (module contract); ``weights`` float32 ``[T, k]``, ``ids`` ``[T, k]``, ``act`` maps
    ``[rows, 2I]`` to ``[rows, I]`` (``silu(gate) * up``)."""
    t, top_k = ids.shape
    if t == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    p = t * top_k
    tiles = moe_tiles(p)
    aligned = align_by_expert(ids, w_gate_up.shape[0], tiles[0])
    gate_up = torch.empty(p, w_gate_up.shape[1], dtype=x.dtype, device=x.device)
    _gemm(x, w_gate_up, gate_up, aligned, top_k, tiles)
    h = act(gate_up)
    if h.stride(-1) != 1:
        h = h.contiguous()
    y = torch.empty(p, w_down.shape[1], dtype=x.dtype, device=x.device)
    _gemm(h, w_down, y, aligned, 1, tiles, weights.reshape(-1).float().contiguous())
    by_expert = torch.argsort(ids, dim=1, stable=True)
    y = torch.gather(y.view(t, top_k, -1), 1,
                     by_expert.unsqueeze(-1).expand(t, top_k, y.shape[-1]))
    out = y[:, 0].clone()
    for j in range(1, top_k):
        out = out + y[:, j]
    return out
