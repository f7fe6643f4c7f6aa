"""Reference kernels in plain PyTorch: the truth the Triton kernels are tested against.

Written for reading, not speed: one sequence at a time, K/V gathered through the block table
into contiguous tensors, softmax in fp32. Same signatures as the Triton kernels.

Layout shared by every kernel:

* KV pool per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``; K is stored after RoPE.
* Slot ``s`` is row ``s % block_size`` of block ``s // block_size``; slot -1 means "do not store".
* ``block_tables[b, i]`` is the physical block holding keys ``i*block_size .. (i+1)*block_size-1``
  of sequence ``b``; entries past ``ceil(seq_lens[b] / block_size)`` are padding and never read.
* Query token ``i`` of sequence ``b`` (``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]``) sits at
  position ``pos = seq_lens[b] - q_len + i`` and sees keys ``j <= pos`` with, when
  ``sliding_window`` is set, ``pos - j < sliding_window``.
* Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, KVH, D]`` into their slots of the pools, in place.

    Tokens whose slot is -1 are skipped. Slots must be distinct (a slot written twice in one
    call has no defined winner).
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Keys (or values) ``0 .. seq_len-1`` of one sequence, contiguous: ``[seq_len, KVH, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, KVH, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def attention_mask(q_len: int, seq_len: int, sliding_window: int | None,
                   device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``[q_len, seq_len]``: True where query ``i`` may see key ``j``."""
    pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    keys = torch.arange(seq_len, device=device)[None, :]
    mask = keys <= pos
    if sliding_window is not None:
        mask &= pos - keys < sliding_window
    return mask


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float,
                    sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the last ``q_len`` tokens of each sequence over its cached keys.

    ``query`` is ``[T, H, D]`` with sequences packed back to back as ``cu_seqlens_q`` says;
    returns ``[T, H, D]`` in ``query``'s dtype. K/V of the query tokens must already be stored.
    ``softcap`` (Gemma 2): each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``
    before the mask and softmax.
    """
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len).float()  # [S, KVH, D]
        v = gather_kv(v_cache, block_tables[b], seq_len).float()
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        mask = attention_mask(q_len, seq_len, sliding_window, query.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None,
                           sliding_window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence (``query`` ``[B, H, D]``), at position ``seq_lens[b] - 1``.

    ``num_splits`` only shapes the Triton kernel's work; the result does not depend on it.
    """
    batch = query.shape[0]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=query.device)
    return paged_attention(query, k_cache, v_cache, block_tables, cu, seq_lens, scale,
                           sliding_window, softcap)


def copy_blocks(src: torch.Tensor | Sequence[torch.Tensor],
                dst: torch.Tensor | Sequence[torch.Tensor], mapping: torch.Tensor) -> None:
    """For each row ``(s, d)`` of ``mapping`` ``[N, 2]``, copy block ``s`` of every source pool
    into block ``d`` of the matching destination pool (any devices). All sources are read before
    any destination is written."""
    srcs = [src] if isinstance(src, torch.Tensor) else list(src)
    dsts = [dst] if isinstance(dst, torch.Tensor) else list(dst)
    pairs = mapping.tolist()
    for s_pool, d_pool in zip(srcs, dsts, strict=True):
        blocks = [s_pool[s].clone() for s, _ in pairs]
        for (_, d), block in zip(pairs, blocks, strict=True):
            d_pool[d] = block.to(d_pool.device)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """``y[t] = x[t] @ a[row_slots[t]].T`` in float32 (``x`` ``[T, K]``, ``a`` ``[S, N, K]``),
    0 for rows whose slot is -1. Returns a new float32 ``[T, N]``."""
    y = torch.zeros(x.shape[0], a.shape[1], device=x.device, dtype=torch.float32)
    for slot in row_slots.unique().tolist():
        if slot < 0:
            continue
        rows = row_slots == slot
        y[rows] = x[rows].float() @ a[slot].float().t()
    return y


def lora_expand_ref(y: torch.Tensor, b: torch.Tensor, row_slots: torch.Tensor,
                    out: torch.Tensor, y_offset: int, out_offset: int) -> None:
    """``out[t, out_offset:out_offset+M] += (y[t, y_offset:y_offset+R] @ b[row_slots[t]].T)``
    cast to ``out``'s dtype, in place (``y`` ``[T, N]`` float32, ``b`` ``[S, M, R]``), for rows
    whose slot is not -1; everything else in ``out`` is left as it is."""
    m, r = b.shape[1:]
    for slot in row_slots.unique().tolist():
        if slot < 0:
            continue
        rows = row_slots == slot
        delta = y[rows, y_offset:y_offset + r] @ b[slot].float().t()
        out[rows, out_offset:out_offset + m] += delta.to(out.dtype)
