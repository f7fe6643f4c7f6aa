"""Triton PagedAttention over the paged KV pool: mixed prefill / chunked prefill / decode.

One program handles ``BLOCK_M`` query *rows* of one sequence and one KV head, where a row is a
(query token, query head of the GQA group) pair: rows ``r`` -> token ``r // G``, head
``kv_head * G + r % G``. Folding the group into the rows means the group's heads share every
K/V load, and a decode (one token, ``G`` heads) still fills a tensor-core tile. Keys are walked
in tiles of ``BLOCK_N`` with an online softmax in fp32, skipping tiles that are entirely in the
future of the program's rows (causality) or entirely outside the sliding window.

The jit helper ``_attend_kv_tile`` (load one K/V tile through the block table, one
online-softmax step) is shared with the decode kernel (kernels/paged_decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_config import prefill_launch_config

LOG2E = 1.4426950408889634


@triton.jit
def _attend_kv_tile(acc, m_i, l_i, q, mask, j_valid, start, n_limit,
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


# Kept out of Triton's per-value specialisation (see kernels/paged_decode.py): the window, the
# block-table row stride (the table is as wide as the step's longest sequence) and the
# alignment of the index tensors, which the backend passes as row slices at any offset.
@triton.jit(do_not_specialize=["window", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_q_ptr", "seq_lens_ptr"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_q_ptr, seq_lens_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_blk, stride_slot, stride_kvh, stride_bt,
    head_dim,
    G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SINGLE_PAGE: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # position of the sequence's first query token

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // G
    head = kvh * G + rows % G
    row_valid = tok < q_len
    pos = ctx + tok
    d = tl.arange(0, BLOCK_D)
    d_valid = d < head_dim

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # Key range seen by any row of this program; empty when the tile is past the sequence's
    # queries (the grid is sized for the longest query), so such programs do no work.
    tok_first = (tile * BLOCK_M) // G
    tok_last = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
    hi = tl.where(tok_first < q_len, ctx + tok_last + 1, 0)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx + tok_first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_kvh
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_valid = j < hi
        mask = (j[None, :] <= pos[:, None]) & j_valid[None, :]
        if USE_WINDOW:
            mask = mask & ((pos[:, None] - j[None, :]) < window)
        acc, m_i, l_i = _attend_kv_tile(
            acc, m_i, l_i, q, mask, j_valid, start, hi, k_cache_ptr, v_cache_ptr, bt_row,
            head_off, d, d_valid, stride_blk, stride_slot, scale_log2,
            BLOCK_SIZE, BLOCK_N, SINGLE_PAGE, DOT_F32, PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_valid[None, :])


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


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    *, max_query_len: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed query tokens over the paged cache (see kernels/reference.py).

    ``query`` ``[T, H, D]`` (last dim contiguous; other strides free) holds the last ``q_len``
    tokens of each sequence, whose K/V are already stored. ``cu_seqlens_q`` ``[B+1]`` and
    ``seq_lens`` ``[B]`` are int32 on the query's device. ``max_query_len`` (the longest
    ``q_len``) spares a device->host sync when the caller knows it. ``out`` may be given
    (``[T, H, D]``, last dim contiguous); it is returned. A query whose dtype differs from the
    cache's is cast to the cache's dtype for the dot products; ``out`` keeps the query's dtype.
    """
    group = check_kv_layout(query, k_cache, v_cache, block_tables)
    num_tokens, num_heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for {batch} seqs")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None; got {sliding_window}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
    if query.dtype != k_cache.dtype or query.stride(-1) != 1:
        query = query.to(k_cache.dtype).contiguous()
    block_d = triton.next_power_of_2(head_dim)
    rows = max_query_len * group
    cfg = prefill_launch_config(head_dim, k_cache.dtype, k_cache.is_cuda, rows)
    block_m, block_n = cfg.block_m, cfg.block_n
    block_size = k_cache.shape[1]
    dot_f32, prec = dot_options(k_cache)
    grid = (batch, k_cache.shape[2], triton.cdiv(rows, block_m))
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens,
        scale * LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim,
        G=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        SINGLE_PAGE=block_n <= block_size, USE_WINDOW=sliding_window is not None,
        DOT_F32=dot_f32, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def __getattr__(name: str):
    # The decode kernel lives in kernels/paged_decode.py (which imports this module); keep
    # ``from kernels.paged_attention import paged_decode_attention`` working all the same.
    if name == "paged_decode_attention":
        from kernels.paged_decode import paged_decode_attention

        return paged_decode_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
