"""Triton PagedAttention over the paged KV pool: mixed prefill / chunked prefill / decode.

One program handles ``BLOCK_M`` query *rows* of one sequence and one KV head, where a row is a
(query token, query head of the GQA group) pair: rows ``r`` -> token ``r // G``, head
``kv_head * G + r % G``. Folding the group into the rows means the group's heads share every
K/V load, and a decode (one token, ``G`` heads) still fills a tensor-core tile. Keys are walked
in tiles of ``BLOCK_N`` with an online softmax in fp32, skipping tiles that are entirely in the
future of the program's rows (causality) or entirely outside the sliding window.

The jit helper ``attend_kv_tile`` (load one K/V tile through the block table, one
online-softmax step) is shared with the decode kernel (kvserve_kernels/paged_decode.py) through
kvserve_kernels/tiles.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve_kernels.kv_quant_layout import kv_quant_kind
from kvserve_kernels.launch_config import prefill_launch_config
from kvserve_kernels.tiles import (
    LOG2E,
    attend_kv_tile,
    check_kv_layout,
    dot_options,
    quant_args,
    softcap_args,
)


# Kept out of Triton's per-value specialisation (see kvserve_kernels/paged_decode.py): the window, the
# block-table row stride (the table is as wide as the step's longest sequence) and the
# alignment of the index tensors, which the backend passes as row slices at any offset.
@triton.jit(do_not_specialize=["window", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_q_ptr", "seq_lens_ptr"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_q_ptr, seq_lens_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_blk, stride_slot, stride_kvh, stride_bt,
    head_dim, k_scale_ptr, v_scale_ptr, cap_in, cap_out,
    G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SINGLE_PAGE: tl.constexpr, USE_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr, KV_QUANT: tl.constexpr, GROUP: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
    k_head_scale = 1.0
    v_head_scale = 1.0
    if KV_QUANT == 2:  # fp8: this KV head's scales
        k_head_scale = tl.load(k_scale_ptr + kvh)
        v_head_scale = tl.load(v_scale_ptr + kvh)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_valid = j < hi
        mask = (j[None, :] <= pos[:, None]) & j_valid[None, :]
        if USE_WINDOW:
            mask = mask & ((pos[:, None] - j[None, :]) < window)
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, mask, j_valid, start, hi, k_cache_ptr, v_cache_ptr, bt_row,
            head_off, d, d_valid, stride_blk, stride_slot, scale_log2,
            k_scale_ptr, v_scale_ptr, k_head_scale, v_head_scale, head_dim,
            BLOCK_SIZE, BLOCK_N, SINGLE_PAGE, DOT_F32, PREC, KV_QUANT, GROUP,
            cap_in, cap_out, SOFTCAP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_valid[None, :])


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    *, max_query_len: int | None = None,
                    out: torch.Tensor | None = None,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of packed query tokens over the paged cache (see kvserve_kernels/reference.py).

    ``query`` ``[T, H, D]`` (last dim contiguous; other strides free) holds the last ``q_len``
    tokens of each sequence, whose K/V are already stored. ``cu_seqlens_q`` ``[B+1]`` and
    ``seq_lens`` ``[B]`` are int32 on the query's device. ``max_query_len`` (the longest
    ``q_len``) spares a device->host sync when the caller knows it. ``out`` may be given
    (``[T, H, D]``, last dim contiguous); it is returned. A query whose dtype differs from the
    cache's is cast to the cache's dtype for the dot products; ``out`` keeps the query's dtype.
    8-bit and int4 pools (kvserve_kernels/kv_quant_layout.py) are dequantised in registers and the dots
    run in the query's dtype; ``kv_scales`` are an fp8 pool's per-head K/V scales (None: 1.0).
    An int4 pool holds rotated rows: the query must be rotated too, and the output comes out
    rotated (engine/attention/triton_backend.py does both). ``softcap`` (Gemma 2): scores
    soft-capped, ``cap * tanh(s / cap)``, before the mask and softmax.
    """
    group = check_kv_layout(query, k_cache, v_cache, block_tables)
    cap_in, cap_out, soft = softcap_args(scale, softcap)
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
    dot_dtype = query.dtype if kv_quant_kind(k_cache) else k_cache.dtype
    if query.dtype != dot_dtype or query.stride(-1) != 1:
        query = query.to(dot_dtype).contiguous()
    block_d = triton.next_power_of_2(head_dim)
    rows = max_query_len * group
    cfg = prefill_launch_config(head_dim, query.dtype if kv_quant_kind(k_cache) else
                                k_cache.dtype, k_cache.is_cuda, rows)
    block_m, block_n = cfg.block_m, cfg.block_n
    block_size = k_cache.shape[1]
    dot_f32, prec = dot_options(k_cache, query.dtype)
    kv_quant, k_scale, v_scale, kv_group = quant_args(k_cache, v_cache, kv_scales, head_dim)
    grid = (batch, k_cache.shape[2], triton.cdiv(rows, block_m))
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens,
        scale * LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim, k_scale, v_scale, cap_in, cap_out,
        G=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        SINGLE_PAGE=block_n <= block_size, USE_WINDOW=sliding_window is not None,
        DOT_F32=dot_f32, PREC=prec, KV_QUANT=kv_quant, GROUP=kv_group, SOFTCAP=soft,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
