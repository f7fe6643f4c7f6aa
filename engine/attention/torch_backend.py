"""PyTorch attention backend: paged KV on any device, tuned for the CPU path.

Per step (``prepare``) it derives, once for all layers, the decode group's gather indices and key
masks (one padded batch, a single SDPA call per layer) and each prefill sequence's block list and
causal mask. Per layer it stores the new K/V, gathers whole blocks and runs SDPA with
grouped-query heads sharing their K/V; quantised and 16-bit pools are converted as stored and
back before SDPA, their decodes on the compiled CPU kernel (rows widened in registers).
The decode group is per query ROW: the leading decodes and, right after them, sequences with a
few new tokens after cached ones (speculative verification: 1 + k rows), each row ``j`` a decode
of its own over keys ``0 .. start + j`` (stored first): exactly a one-token decode at that
position, so speculative greedy output equals one-token decoding. With ``batch_invariant = True``
(``engine.models.batch_invariant``) every CPU row of the step joins the decode group, prompts
and prefix hits included: each query row's attention is the decode kernel's over keys ``0 ..
its position``, the same reduction however the prompt arrived or whatever rows run beside it.
Bidirectional image spans (``meta.bidirectional``, Gemma 3): a sequence with a span that lets
one of this step's queries see a later key takes the prefill path (the decode group, invariant
one included, stops before it), its mask ``(causal OR same span) AND window``, the span part
built once per step; spans wholly before the step's queries are causal already and change
nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.kv_format.formats import (
    KVFormat,
    byte_view,
    dequantize_rows,
    format_of,
    fp8_table,
    gather_blocks,
    quantize_rows,
)

# Sequences right after the decodes with at most this many new tokens join the decode group
# row by row (speculative verification steps); longer chunks take the prefill path.
SMALL_QUERY_ROWS = 17
# Float pools the compiled CPU decode kernel reads (16-bit rows widened in registers).
CPU_KERNEL_FLOAT_POOLS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _DecodeGroup:
    num_rows: int  # the leading token rows it covers
    block_tables: torch.Tensor  # [Bd, MB]
    key_pos: torch.Tensor  # [1, MB * BS]
    seq_lens: torch.Tensor  # [Bd, 1]
    num_keys: int
    tables_i32: torch.Tensor  # [Bd, MB] contiguous, for the compiled CPU kernel
    lens_i32: torch.Tensor  # [Bd]


@dataclass
class _PrefillSeq:
    token_start: int
    token_end: int
    blocks: torch.Tensor  # [nb]
    seq_len: int
    query_pos: torch.Tensor  # [q_len, 1]
    key_pos: torch.Tensor  # [1, seq_len]
    same_span: torch.Tensor | None = None  # [q_len, seq_len] bool: query and key in one span


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._cpu_kernel = None
        self._cpu_kernel_tried = False
        self.batch_invariant = False

    def _decode_kernel(self, q: torch.Tensor, fmt: KVFormat):
        """The compiled CPU paged-decode kernel when it applies (CPU, float32 queries over a
        float32, float16, bfloat16, int8 or fp8 pool), else None."""
        if q.device.type != "cpu" or q.dtype != torch.float32 or \
                (fmt.kind == "float" and fmt.storage_dtype not in CPU_KERNEL_FLOAT_POOLS):
            return None
        return self._cpu_kernels()

    def _cpu_kernels(self):
        """The compiled CPU kernels (engine/cpu/kernels.py), or None; loaded once."""
        if not self._cpu_kernel_tried:
            from engine.cpu.kernels import load

            self._cpu_kernel = load()
            self._cpu_kernel_tried = True
        return self._cpu_kernel

    def prepare(self, meta: AttentionMetadata) -> None:
        state = meta.backend_state
        bs = meta.block_size
        device = meta.block_tables.device
        nd = meta.num_decodes
        q_lens = meta.query_lens_cpu
        spans = _step_spans(meta) if meta.bidirectional else {}
        ns = nd  # sequences in the decode group: the decodes, then the short ones after them
        # A whole prompt (nothing cached) keeps the prefill path: SDPA over its exact K/V.
        if self.batch_invariant and device.type == "cpu":
            # every row a decode row (module docstring), up to the first sequence with a span
            ns = min(spans, default=meta.num_seqs)
        while (ns < meta.num_seqs and q_lens[ns] <= SMALL_QUERY_ROWS
               and meta.seq_lens_cpu[ns] > q_lens[ns] and ns not in spans):
            ns += 1
        state["decode"] = _decode_group(meta, nd, ns) if ns else None
        prefills = []
        start = state["decode"].num_rows if ns else 0
        for b in range(ns, meta.num_seqs):
            q_len, seq_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
            nb = -(-seq_len // bs)
            prefills.append(_PrefillSeq(
                token_start=start,
                token_end=start + q_len,
                blocks=meta.block_tables[b, :nb].long(),
                seq_len=seq_len,
                query_pos=torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1),
                key_pos=torch.arange(seq_len, device=device).unsqueeze(0),
                same_span=_same_span(spans[b], seq_len - q_len, seq_len, device)
                if b in spans else None,
            ))
            start += q_len
        state["prefills"] = prefills
        state["masks"] = {}
        valid = meta.all_slots_valid
        state["store_all"] = valid if valid is not None else \
            not bool((meta.slot_mapping < 0).any())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None,
                kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """The backend contract's ``forward``; ``softcap`` (Gemma 2) caps each scaled score
        ``s`` to ``softcap * tanh(s / softcap)`` before the mask and softmax (the compiled CPU
        decode kernel does it in registers; elsewhere SDPA is bypassed for an explicit
        softmax)."""
        state = meta.backend_state
        fmt = format_of(k_cache, q.shape[-1])
        ks, vs = kv_scales if kv_scales is not None else (None, None)
        self._store(quantize_rows(k, fmt, ks), quantize_rows(v, fmt, vs), k_cache, v_cache,
                    meta.slot_mapping, state["store_all"], self._store_kernel(k_cache))
        kv = _KVReader(fmt, q.dtype, ks, vs)
        out = torch.empty_like(q)
        masks = state["masks"].setdefault(sliding_window, {})
        group = state["decode"]
        if group is not None:
            nd = group.num_rows
            kernel = self._decode_kernel(q, fmt)
            if kernel is not None:
                out[:nd] = _cpu_decode(kernel, fmt, q[:nd], k_cache, v_cache, group,
                                       scale, sliding_window or 0, ks, vs, softcap or 0.0)
            else:
                out[:nd] = self._decode(q[:nd], k_cache, v_cache, group, masks,
                                        scale, sliding_window, kv, softcap)
        for i, seq in enumerate(state["prefills"]):
            lo, hi = seq.token_start, seq.token_end
            if seq.seq_len == hi - lo and sliding_window is None:
                # A whole prompt with nothing cached before it: its keys are this step's own
                # K/V, so skip the gather and let SDPA's causal kernel run without a mask
                # (over an 8-bit pool too, as vLLM does: the exact K/V are at hand); with
                # image spans under an explicit mask.
                mask = None if seq.same_span is None else _prefill_mask(seq, masks, i, None)
                out[lo:hi] = _sdpa_4d(q[lo:hi], k[lo:hi], v[lo:hi], mask, scale, softcap)
                continue
            out[lo:hi] = self._prefill(q[lo:hi], k_cache, v_cache, seq, masks, i, scale,
                                       sliding_window, kv, softcap)
        return out

    def _store_kernel(self, k_cache: torch.Tensor):
        """The compiled CPU kernels (for ``store_kv_cpu``) when the pool is on the CPU."""
        return self._cpu_kernels() if k_cache.device.type == "cpu" else None

    @staticmethod
    def _store(k, v, k_cache, v_cache, slots, store_all: bool, kernels=None) -> None:
        """``k``/``v`` are pool rows already (``quantize_rows``). On the CPU one compiled call
        writes both (negative slots skipped), else two ``index_copy_``."""
        if kernels is not None:
            kernels.store_kv_cpu(byte_view(k), byte_view(v), byte_view(k_cache),
                                 byte_view(v_cache), slots)
            return
        kvh, w = k_cache.shape[-2:]
        if not store_all:
            keep = slots >= 0
            slots, k, v = slots[keep], k[keep], v[keep]
        byte_view(k_cache).view(-1, kvh, w).index_copy_(0, slots, byte_view(k))
        byte_view(v_cache).view(-1, kvh, w).index_copy_(0, slots, byte_view(v))

    @staticmethod
    def _decode(q, k_cache, v_cache, group: _DecodeGroup, masks, scale, window,
                kv: _KVReader, softcap: float | None = None):
        mask = masks.get("decode")
        if mask is None:
            valid = group.key_pos < group.seq_lens
            if window is not None:
                valid &= group.key_pos >= group.seq_lens - window
            mask = masks["decode"] = valid[:, None, None, :]  # [Bd, 1, 1, L]
        bd = q.shape[0]
        kvh, w = k_cache.shape[-2:]
        keys = kv.keys(gather_blocks(k_cache, group.block_tables).view(bd, -1, kvh, w))
        vals = kv.values(gather_blocks(v_cache, group.block_tables).view(bd, -1, kvh, w))
        if softcap is not None:
            out = softcapped_attention(q.unsqueeze(2), keys.transpose(1, 2),
                                       vals.transpose(1, 2), mask, scale, softcap)
            return out.squeeze(2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask,
            scale=scale, enable_gqa=True)
        return out.squeeze(2)

    @staticmethod
    def _prefill(q, k_cache, v_cache, seq: _PrefillSeq, masks, idx, scale, window,
                 kv: _KVReader, softcap: float | None = None):
        mask = _prefill_mask(seq, masks, idx, window)
        kvh, w = k_cache.shape[-2:]
        keys = kv.keys(gather_blocks(k_cache, seq.blocks).view(-1, kvh, w)[: seq.seq_len])
        vals = kv.values(gather_blocks(v_cache, seq.blocks).view(-1, kvh, w)[: seq.seq_len])
        return _sdpa_4d(q, keys, vals, mask, scale, softcap)


def _prefill_mask(seq: _PrefillSeq, masks: dict, idx: int, window: int | None) -> torch.Tensor:
    """Prefill sequence ``idx``'s ``[q_len, seq_len]`` mask (True = attend), cached in
    ``masks`` (the window's): ``(causal OR same span) AND window``."""
    mask = masks.get(idx)
    if mask is None:
        mask = seq.key_pos <= seq.query_pos
        if seq.same_span is not None:
            mask = mask | seq.same_span
        if window is not None:
            mask &= seq.key_pos > seq.query_pos - window
        masks[idx] = mask
    return mask


def _step_spans(meta: AttentionMetadata) -> dict[int, list[tuple[int, int]]]:
    """Per sequence index, the spans of ``meta.bidirectional`` through which a query of this
    step sees a later key (a query position ``p`` in ``[first, end)`` with ``p < end - 1``);
    the others are covered by the causal mask. Raises ``ValueError`` when such a span ends
    past the sequence's keys (the scheduler split it)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for b, first, end in meta.bidirectional:
        seq_len = meta.seq_lens_cpu[b]
        lo = max(first, seq_len - meta.query_lens_cpu[b])  # the span's first query position
        if lo >= min(end - 1, seq_len):
            continue
        if end > seq_len:
            raise ValueError(f"image span [{first}, {end}) of sequence {b} ends past its "
                             f"{seq_len} keys: a span must not be split across steps")
        spans.setdefault(b, []).append((first, end))
    return spans


def _same_span(spans: list[tuple[int, int]], q_start: int, seq_len: int,
               device: torch.device) -> torch.Tensor:
    """``[seq_len - q_start, seq_len]`` bool: query position ``q_start + i`` and key position
    ``j`` lie in one of ``spans`` (each ``(first, end)`` with ``end <= seq_len``)."""
    same = torch.zeros(seq_len - q_start, seq_len, dtype=torch.bool, device=device)
    for first, end in spans:
        same[max(first, q_start) - q_start:end - q_start, first:end] = True
    return same


def _cpu_decode(kernel, fmt: KVFormat, q, k_cache, v_cache, group: _DecodeGroup, scale, window,
                k_scale, v_scale, softcap: float = 0.0) -> torch.Tensor:
    """The compiled CPU decode kernel for the pool's format (module docstring); ``softcap``
    > 0 soft-caps the scores (Gemma 2)."""
    args = (group.tables_i32, group.lens_i32, scale, window)
    if fmt.kind == "float":
        return kernel.paged_decode_cpu(q, k_cache, v_cache, *args, softcap=softcap)
    if fmt.kind == "int8":
        return kernel.paged_decode_cpu_int8(q, k_cache, v_cache, *args, softcap=softcap)
    if fmt.kind == "int4":  # rows hold (K/s)·R and V·R: fold s and R into the query, R back
        # (the compiled rotation: bit-identical to int4_rotate, without its ~10 torch ops)
        rotate = kernel.int4_rotate_cpu
        group = q.shape[1] // k_cache.shape[2]
        if k_scale is not None:  # calibrated per-channel key smoothing [KVH, D]
            q = q * k_scale.repeat_interleave(group, dim=0)
        out = rotate(kernel.paged_decode_cpu_int4(rotate(q), k_cache, v_cache, *args,
                                                  softcap=softcap))
        if v_scale is not None:
            out = out * v_scale.repeat_interleave(group, dim=0)
        return out
    kvh = k_cache.shape[2]
    ones = torch.ones(kvh)
    return kernel.paged_decode_cpu_fp8(
        q, byte_view(k_cache), byte_view(v_cache), *args, fp8_table(fmt.storage_dtype),
        ones if k_scale is None else k_scale, ones if v_scale is None else v_scale,
        softcap=softcap)


@dataclass(frozen=True)
class _KVReader:
    """Gathered pool rows -> K/V of the queries' dtype (dequantised for 8-bit pools)."""

    fmt: KVFormat
    dtype: torch.dtype
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def keys(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(rows, self.fmt, self.dtype, self.k_scale)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(rows, self.fmt, self.dtype, self.v_scale)


def _decode_group(meta: AttentionMetadata, nd: int, ns: int) -> _DecodeGroup:
    """The decode group of the first ``ns`` sequences (``nd`` of them plain decodes), one row
    per query token: row j of a sequence with q new tokens attends ``seq_len - q + j + 1``
    keys through that sequence's block table."""
    bs = meta.block_size
    device = meta.block_tables.device
    if ns == nd:  # decodes only: one row per sequence
        tables = meta.block_tables[:nd]
        lens = meta.seq_lens[:nd]
        max_len = max(meta.seq_lens_cpu[:nd])
    else:
        q_lens = meta.query_lens_cpu[:ns]
        counts = torch.tensor(q_lens, device=device)
        tables = meta.block_tables[:ns].repeat_interleave(counts, dim=0)
        ends = meta.seq_lens[:ns].long()
        cu = torch.cumsum(counts, 0) - counts
        rows = torch.arange(int(sum(q_lens)), device=device)
        seq_of = torch.repeat_interleave(torch.arange(ns, device=device), counts)
        lens = ends[seq_of] - counts[seq_of] + (rows - cu[seq_of]) + 1
        max_len = max(meta.seq_lens_cpu[:ns])
    mb = -(-max_len // bs)
    return _DecodeGroup(
        num_rows=int(lens.shape[0]),
        block_tables=tables[:, :mb].long(),
        key_pos=torch.arange(mb * bs, device=device).unsqueeze(0),
        seq_lens=lens.long().unsqueeze(1),
        num_keys=mb * bs,
        tables_i32=tables[:, :mb].to(torch.int32).contiguous(),
        lens_i32=lens.to(torch.int32).contiguous(),
    )


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """SDPA with tanh soft-capped scores (HF Gemma 2's eager attention): q ``[B, H, Lq, D]``,
    k/v ``[B, KVH, Lk, D]`` (KV heads shared by groups of query heads), ``mask`` boolean
    (True = attend) broadcastable to ``[B, H, Lq, Lk]``, or None for causal (Lq == Lk)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        lq, lk = q.shape[-2], k.shape[-2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _sdpa_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             scale: float, softcap: float | None = None) -> torch.Tensor:
    """One sequence's attention: q ``[Tq, H, D]``, k/v ``[Tk, KVH, D]`` -> ``[Tq, H, D]``.

    Causal when ``mask`` is None (Tq == Tk). K/V heads are repeated for their query-head group
    and the inputs given a batch dimension: on CPU that routes SDPA to its flash kernel, which
    measured faster than the 3-D / ``enable_gqa`` call (docs/decisions.md#small-cpu-costs).
    """
    if softcap is not None:
        out = softcapped_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                   v.transpose(0, 1).unsqueeze(0), mask, scale, softcap)
        return out[0].transpose(0, 1)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1)
