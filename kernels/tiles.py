"""Pieces shared by the two Triton attention kernels (kernels/paged_attention.py for mixed
prefill/decode, kernels/paged_decode.py for the one-token split-K path): the jit helper that
loads one K/V tile through the block table and folds it into an online softmax, the layout
check of their common arguments, and the dot-product options per cache dtype.

Both kernel modules import this one and not each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def attend_kv_tile(acc, m_i, l_i, q, mask, j_valid, start, n_limit,
                   k_cache_ptr, v_cache_ptr, bt_row_ptr, head_off, d, d_valid,
                   stride_blk, stride_slot, scale_log2,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PAGE: tl.constexpr,
                   DOT_F32: tl.constexpr, PREC: tl.constexpr):
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
    k = tl.load(k_cache_ptr + rows[None, :] + d[:, None],
                mask=j_valid[None, :] & d_valid[:, None], other=0.0)  # [D, N]
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :],
                mask=j_valid[:, None] & d_valid[None, :], other=0.0)  # [N, D]

    if DOT_F32:
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=PREC)
    else:
        qk = tl.dot(q, k, input_precision=PREC)
    qk = tl.where(mask, qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PREC)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PREC)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


def check_kv_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor) -> int:
    """Validate shapes shared by both attention kernels; return the GQA group size."""
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
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two; got {block_size}")
    if block_tables.dim() != 2 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be a [batch, max_blocks] tensor, contiguous rows")
    return num_heads // num_kv_heads


def dot_options(cache: torch.Tensor) -> tuple[bool, str | None]:
    """(DOT_F32, PREC) for a cache. fp32 asks for IEEE dots (no silent TF32 on GPU). The CPU
    interpreter multiplies bf16 bit patterns as integers, so bf16 is upcast there."""
    dot_f32 = cache.dtype == torch.bfloat16 and not cache.is_cuda
    prec = "ieee" if cache.dtype == torch.float32 else None
    return dot_f32, prec
