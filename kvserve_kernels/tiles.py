"""Pieces shared by the two Triton attention kernels (kvserve_kernels/paged_attention.py for mixed
prefill/decode, kvserve_kernels/paged_decode.py for the one-token split-K path): the jit helper that
loads one K/V tile through the block table and folds it into an online softmax, the layout
check of their common arguments, and the dot-product options per cache dtype.

Both kernel modules import this one and not each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve_kernels.int4_rows import load_int4
from kvserve_kernels.kv_quant_layout import int4_group, kv_quant_kind, kv_row_width, unit_scales

LOG2E = 1.4426950408889634


@triton.jit
def attend_kv_tile(acc, m_i, l_i, q, mask, j_valid, start, n_limit,
                   k_cache_ptr, v_cache_ptr, bt_row_ptr, head_off, d, d_valid,
                   stride_blk, stride_slot, scale_log2,
                   k_scale_ptr, v_scale_ptr, k_head_scale, v_head_scale, head_dim,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PAGE: tl.constexpr,
                   DOT_F32: tl.constexpr, PREC: tl.constexpr, KV_QUANT: tl.constexpr,
                   GROUP: tl.constexpr, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Load keys/values ``start .. start+BLOCK_N-1`` of one sequence and KV head and fold them
    into the running online softmax (``acc`` ``[M, D]``, max ``m_i``, sum ``l_i``, fp32) of the
    query rows ``q`` ``[M, D]``. ``mask`` ``[M, N]`` says which row sees which key;
    ``j_valid`` ``[N]`` which keys may be loaded (all below ``n_limit``).

    ``start`` is a multiple of ``BLOCK_N``. With ``SINGLE_PAGE`` (``BLOCK_N <= BLOCK_SIZE``) the
    tile lies inside one page: one block-table read and contiguous rows the compiler can
    vectorise; otherwise each key looks up its own page. Scores live in the log2 domain
    (``scale_log2`` = scale * log2 e) so ``exp2`` is used. Rows with nothing visible yet keep
    ``m_i = -inf``; the ``m_safe`` guard avoids inf - inf. (One helper per tile rather than two
    also halves the Triton interpreter's per-call patching cost in the CPU tests.)

    Quantised pools (kvserve_kernels/kv_quant_layout.py), dequantised in registers: ``KV_QUANT == 1``
    (int8) reads each key's and value's float16 row scale through ``k_scale_ptr`` /
    ``v_scale_ptr`` (the pools' float16 views) and applies it to that key's score column and
    that value's softmax weight; ``KV_QUANT == 2`` (fp8) multiplies the scores and the weighted
    sum by the head's ``k_head_scale`` / ``v_head_scale``. The values themselves convert exactly
    to the queries' dtype for the dots. ``KV_QUANT == 3`` (int4, scales per ``GROUP`` elements
    inside the row) dequantises each element in float32 (kvserve_kernels/int4_rows.py) and converts it
    to the queries' dtype (exact for float32 queries; the one rounding a 16-bit model's
    PyTorch path also makes).

    ``SOFTCAP`` (Gemma 2): each scaled score ``s`` becomes ``cap * tanh(s / cap)`` before the
    mask; the caller passes ``cap_in = scale / cap`` and ``cap_out = cap * log2 e``, and tanh
    is computed as ``1 - 2 / (e^(2x) + 1)`` (exact limits at both ends, float32).
    """
    offs = tl.arange(0, BLOCK_N)
    if SINGLE_PAGE:
        blk = tl.load(bt_row_ptr + start // BLOCK_SIZE).to(tl.int64)
        rows = blk * stride_blk + ((start % BLOCK_SIZE) + offs).to(tl.int64) * stride_slot
    else:
        j = start + offs
        blk = tl.load(bt_row_ptr + j // BLOCK_SIZE, mask=j < n_limit, other=0).to(tl.int64)
        rows = blk * stride_blk + (j % BLOCK_SIZE).to(tl.int64) * stride_slot
    rows += head_off
    if KV_QUANT == 3:
        k = load_int4(k_cache_ptr, rows[None, :], d[:, None],
                      j_valid[None, :] & d_valid[:, None], head_dim, GROUP)  # [D, N]
        v = load_int4(v_cache_ptr, rows[:, None], d[None, :],
                      j_valid[:, None] & d_valid[None, :], head_dim, GROUP)  # [N, D]
    else:
        k = tl.load(k_cache_ptr + rows[None, :] + d[:, None],
                    mask=j_valid[None, :] & d_valid[:, None], other=0.0)  # [D, N]
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :],
                    mask=j_valid[:, None] & d_valid[None, :], other=0.0)  # [N, D]

    if KV_QUANT != 0:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if DOT_F32:
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=PREC)
    else:
        qk = tl.dot(q, k, input_precision=PREC)
    if KV_QUANT == 1:
        ks = tl.load(k_scale_ptr + (rows + head_dim) // 2, mask=j_valid, other=0.0)
        qk = qk * ks.to(tl.float32)[None, :]
    elif KV_QUANT == 2:
        qk = qk * k_head_scale
    if SOFTCAP:
        x = qk * cap_in
        qk = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * cap_out
    else:
        qk = qk * scale_log2
    qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_QUANT == 1:  # a value row's scale rides on its weight (after the sum)
        vs = tl.load(v_scale_ptr + (rows + head_dim) // 2, mask=j_valid, other=0.0)
        p = p * vs.to(tl.float32)[None, :]
    elif KV_QUANT == 2:
        p = p * v_head_scale
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PREC)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PREC)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


def softcap_args(scale: float, softcap: float | None) -> tuple[float, float, bool]:
    """``attend_kv_tile``'s ``cap_in``, ``cap_out`` and ``SOFTCAP`` for a soft-cap (None or
    0: off)."""
    if not softcap:
        return 0.0, 0.0, False
    if softcap < 0:
        raise ValueError(f"softcap must be > 0 or None; got {softcap}")
    return scale / softcap, softcap * LOG2E, True


def check_kv_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor) -> int:
    """Validate shapes shared by both attention kernels; return the GQA group size. Pools
    are ``[blocks, block_size, kv_heads, W]``: W is head_dim, head_dim + 2 for int8, or
    head_dim / 2 + 2 * groups for int4 (kvserve_kernels/kv_quant_layout.py)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim]; got {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be equal [blocks, block_size, kv_heads, "
                         f"head_dim]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout, contiguous in head_dim")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    width = kv_row_width(kv_quant_kind(k_cache), head_dim)
    if k_cache.shape[3] != width:
        raise ValueError(f"query head_dim {head_dim} needs cache rows of {width}; got "
                         f"{k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two; got {block_size}")
    if block_tables.dim() != 2 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be a [batch, max_blocks] tensor, contiguous rows")
    return num_heads // num_kv_heads


def dot_options(cache: torch.Tensor,
                query_dtype: torch.dtype | None = None) -> tuple[bool, str | None]:
    """(DOT_F32, PREC) for a cache. fp32 asks for IEEE dots (no silent TF32 on GPU). The CPU
    interpreter multiplies bf16 bit patterns as integers, so bf16 is upcast there. Over an
    8-bit or int4 pool the dots run in the queries' dtype (``query_dtype``)."""
    dtype = query_dtype if kv_quant_kind(cache) and query_dtype is not None else cache.dtype
    dot_f32 = dtype == torch.bfloat16 and not cache.is_cuda
    prec = "ieee" if dtype == torch.float32 else None
    return dot_f32, prec


def quant_args(k_cache: torch.Tensor, v_cache: torch.Tensor,
               kv_scales: tuple[torch.Tensor, torch.Tensor] | None, head_dim: int) -> tuple:
    """``(KV_QUANT, k_scale_ptr, v_scale_ptr, GROUP)`` for the kernels (fp8 kernels load their
    head's scales from the pointers): the int8 pools' float16 views, or the fp8 per-head scale
    tensors (1.0 when None); int4 pools keep their scales inside their rows (the pools
    themselves are passed) and ``GROUP`` is their elements per scale (2 for the other pools,
    which do not read it: one fixed value, so no extra compiled variant)."""
    kind = kv_quant_kind(k_cache)
    if kind == 1:
        return kind, k_cache.view(torch.float16), v_cache.view(torch.float16), 2
    if kind == 2:
        ks, vs = kv_scales if kv_scales is not None else \
            unit_scales(k_cache.shape[2], k_cache.device)
        return kind, ks, vs, 2
    return kind, k_cache, v_cache, int4_group(head_dim) if kind == 3 else 2
