"""Triton decode attention (one query token per sequence) with split-K (flash-decoding).

Decode is bound by reading K/V, so the kernel is shaped around loads:

* one program per (sequence, KV head, split): the ``G`` query heads of the GQA group are the
  rows of one tile (padded to 16 for the tensor cores), so each K/V tile is loaded once per
  group, not once per query head;
* with few sequences the (sequence, KV head) grid cannot fill the GPU, so each context is cut
  into ``num_splits`` contiguous key ranges processed in parallel; each writes an unnormalised
  partial output with its running max and sum, and a second kernel merges the partials by
  log-sum-exp. With one split the first kernel normalises and writes the output directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve_kernels.kv_quant_layout import kv_quant_kind
from kvserve_kernels.launch_config import decode_launch_config
from kvserve_kernels.tiles import (
    LOG2E,
    attend_kv_tile,
    check_kv_layout,
    dot_options,
    quant_args,
    softcap_args,
)

# A split shorter than this spends more on its launch share and merge than it saves.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Decode programs resident per SM at the default launch choices (head_dim 128); the value in
# use comes from kvserve_kernels.launch_config.decode_launch_config (per head_dim, env-overridable).
PROGRAMS_PER_SM = 4


# Triton compiles one variant per distinct specialisation of the integer arguments (== 1,
# divisible by 16) and of pointer alignment (16 bytes). Arguments that change from step to
# step are kept out of it, so that serving never meets a new variant: the split count and
# window, the block-table row stride (the table is as wide as the step's longest sequence),
# and the index tensors, which arrive as row slices of the step's tables at any offset (they
# are only read one scalar at a time, so their alignment buys nothing). Strides of the query,
# output and pools and head_dim are fixed per model and stay specialised.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    block_tables_ptr, seq_lens_ptr,
    scale_log2, window, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_blk, stride_slot, stride_kvh, stride_bt,
    head_dim, k_scale_ptr, v_scale_ptr, cap_in, cap_out,
    G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SINGLE_PAGE: tl.constexpr, USE_WINDOW: tl.constexpr,
    ONE_PASS: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    KV_QUANT: tl.constexpr, GROUP: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)

    g = tl.arange(0, BLOCK_H)
    head = kvh * G + g
    h_valid = g < G
    d = tl.arange(0, BLOCK_D)
    d_valid = d < head_dim
    hd_mask = h_valid[:, None] & d_valid[None, :]
    q_rows = b.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=hd_mask, other=0.0)

    # Visible keys are [lo, seq_len): the query sits at seq_len - 1. Splits cut the
    # BLOCK_N-aligned range into equal runs of whole tiles.
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(seq_len - lo_tile, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start_key = lo_tile + split * tiles_per_split * BLOCK_N
    end_key = tl.minimum(start_key + tiles_per_split * BLOCK_N, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_kvh
    k_head_scale = 1.0
    v_head_scale = 1.0
    if KV_QUANT == 2:  # fp8: this KV head's scales
        k_head_scale = tl.load(k_scale_ptr + kvh)
        v_head_scale = tl.load(v_scale_ptr + kvh)
    for start in range(start_key, end_key, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_valid = (j < end_key) & (j >= lo)
        mask = j_valid[None, :] & h_valid[:, None]
        acc, m_i, l_i = attend_kv_tile(
            acc, m_i, l_i, q, mask, j_valid, start, end_key, k_cache_ptr, v_cache_ptr, bt_row,
            head_off, d, d_valid, stride_blk, stride_slot, scale_log2,
            k_scale_ptr, v_scale_ptr, k_head_scale, v_head_scale, head_dim,
            BLOCK_SIZE, BLOCK_N, SINGLE_PAGE, DOT_F32, PREC, KV_QUANT, GROUP,
            cap_in, cap_out, SOFTCAP)

    if ONE_PASS:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0: no keys, output zeros
        out = acc / l_safe[:, None]
        o_rows = b.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hd_mask)
    else:
        # Partials: acc [B, H, S, BLOCK_D] and (max, sum) [B, H, S, 2], fp32, contiguous.
        row = (b.to(tl.int64) * (tl.num_programs(1) * G) + head) * num_splits + split
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc,
                 mask=h_valid[:, None] & (d[None, :] < BLOCK_D))
        tl.store(part_ml_ptr + row * 2, m_i, mask=h_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=h_valid)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, num_splits, stride_ob, stride_oh, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_valid = s < num_splits
    d = tl.arange(0, BLOCK_D)
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_valid, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + row * 2 + 1, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)  # empty splits carry m = -inf: weight 0
    denom = tl.sum(w * l_part, 0)
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :],
                  mask=s_valid[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    out = num / tl.where(denom == 0.0, 1.0, denom)
    o_off = b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the CPU interpreter: any small nominal machine keeps the heuristic exercised


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      *, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> int:
    """Split count for a decode batch: 1 when the (sequence, KV head) programs already fill
    the GPU; otherwise the fewest splits whose programs fill whole waves of resident programs
    about as well as any count can, with no split shorter than MIN_KEYS_PER_SPLIT keys.

    ``head_dim``/``dtype`` select the launch config whose ``programs_per_sm`` counts the
    resident programs. Cheap: a few dictionary look-ups after the first call per shape (the
    result depends only on the program count, ``max_seq_len // MIN_KEYS_PER_SPLIT`` capped at
    MAX_SPLITS, and the device), so it may run every step; a CUDA-graph capture calls it once
    per batch bucket and passes the result as ``num_splits``.
    """
    pps = decode_launch_config(head_dim, dtype, device.type == "cuda").programs_per_sm
    return _choose_splits(batch * num_kv_heads, max_seq_len, device, pps)


def _choose_splits(programs: int, max_seq_len: int, device: torch.device,
                   programs_per_sm: int) -> int:
    limit = max(1, min(max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))
    return _splits_for(max(1, programs), limit, programs_per_sm * _num_sms(device))


@functools.lru_cache(maxsize=4096)
def _splits_for(programs: int, limit: int, slots: int) -> int:
    if programs >= slots:
        return 1
    fills = [programs * s / (triton.cdiv(programs * s, slots) * slots)
             for s in range(1, limit + 1)]
    good_enough = 0.95 * max(fills)  # a few % of fill is not worth more splits to merge
    return next(s for s, fill in enumerate(fills, start=1) if fill >= good_enough)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, sliding_window: int | None = None,
                           *, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None,
                           kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of one new token per sequence (``query`` ``[B, H, D]``, at position
    ``seq_lens[b] - 1``, its K/V already stored) over the paged cache; returns ``[B, H, D]``.

    ``num_splits=None`` picks a split count from batch size and context length
    (``max_seq_len``, read from ``seq_lens`` when not given, which costs a device sync); a
    caller that needs a fixed launch shape (a CUDA-graph capture) passes its own count.
    Changing ``num_splits``, the window or the block-table width between calls reuses the
    compiled kernels (only ``num_splits == 1`` vs more, and the merge's power-of-two bucket
    of ``num_splits``, are separate variants).
    The result does not depend on ``num_splits`` beyond float rounding. 8-bit and int4 pools
    (kvserve_kernels/kv_quant_layout.py) are dequantised in registers; ``kv_scales`` are an fp8 pool's
    per-head K/V scales (None: 1.0). An int4 pool holds rotated rows: the query must be
    rotated too, and the output comes out rotated (engine/attention/triton_backend.py).
    ``softcap`` (Gemma 2): scores soft-capped, ``cap * tanh(s / cap)``, before the softmax.
    """
    group = check_kv_layout(query, k_cache, v_cache, block_tables)
    cap_in, cap_out, soft = softcap_args(scale, softcap)
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {batch} queries")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None; got {sliding_window}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None; got {num_splits}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    cfg = decode_launch_config(head_dim, query.dtype if kv_quant_kind(k_cache) else
                               k_cache.dtype, k_cache.is_cuda)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        if sliding_window is not None:
            max_seq_len = min(max_seq_len, sliding_window)
        num_splits = _choose_splits(batch * num_kv_heads, max_seq_len, query.device,
                                    cfg.programs_per_sm)
    dot_dtype = query.dtype if kv_quant_kind(k_cache) else k_cache.dtype
    if query.dtype != dot_dtype or query.stride(-1) != 1:
        query = query.to(dot_dtype).contiguous()

    block_d = triton.next_power_of_2(head_dim)
    block_n = cfg.block_n
    one_pass = num_splits == 1
    if one_pass:
        part_acc = part_ml = out  # unused by the kernel; any tensor will do
    else:
        part_acc = torch.empty(batch, num_heads, num_splits, block_d, dtype=torch.float32,
                               device=query.device)
        part_ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32,
                              device=query.device)
    dot_f32, prec = dot_options(k_cache, query.dtype)
    kv_quant, k_scale, v_scale, kv_group = quant_args(k_cache, v_cache, kv_scales, head_dim)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_acc, part_ml, block_tables, seq_lens,
        scale * LOG2E, sliding_window or 0, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        head_dim, k_scale, v_scale, cap_in, cap_out,
        G=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, BLOCK_D=block_d, SINGLE_PAGE=block_n <= block_size,
        USE_WINDOW=sliding_window is not None, ONE_PASS=one_pass,
        DOT_F32=dot_f32, PREC=prec, KV_QUANT=kv_quant, GROUP=kv_group, SOFTCAP=soft,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not one_pass:
        _merge_kernel[(batch, num_heads)](
            out, part_acc, part_ml, num_splits, out.stride(0), out.stride(1), head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out
