"""Triton attention backend: the paged KV pool read by kvserve_kernels/ on NVIDIA GPUs.

Per layer: ``store_kv`` writes the step's keys/values, then the leading decodes (``q_len == 1``)
go through ``paged_decode_attention`` (GQA-grouped loads, split-K over long contexts) and the
remaining prefills / chunks through ``paged_attention``. ``prepare`` derives, once per step,
the per-group views and host-side maxima so that no layer needs a device->host sync.

An int4 pool (engine/kv_format/formats.py) holds ``k @ R`` and ``v @ R`` (``R`` the per-group
Walsh-Hadamard rotation), which the kernels read as plain 4-bit rows: this backend rotates the
keys and values before ``store_kv`` (in float32, as ``quantize_rows`` does, so the pool's bytes
are the PyTorch backend's), attends with the rotated queries and rotates the output back. Under
``calculate_kv_scales`` the layer's ``kv_scales`` are an int4 pool's per-channel key smoothing
``s`` (engine/kv_format/calibration.py): ``k / s`` is stored and ``q * s`` attends.
On a CPU the kernels only run under ``TRITON_INTERPRET=1`` (slow; used by the tests).
Bidirectional image spans (``meta.bidirectional``, Gemma 3) are refused: ``prepare`` and
``forward`` raise ``NotImplementedError`` when any is given."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.kv_format.formats import int4_rotate
from kvserve_kernels.kv_quant_layout import kv_quant_kind
from kvserve_kernels.paged_attention import paged_attention
from kvserve_kernels.paged_decode import paged_decode_attention
from kvserve_kernels.store_kv import store_kv


@dataclass
class _DecodePart:
    num_tokens: int
    block_tables: torch.Tensor  # [Bd, max_blocks]
    seq_lens: torch.Tensor  # [Bd]
    max_seq_len: int
    num_splits: int | None  # fixed (CUDA-graph bucket) or None: the kernel chooses


@dataclass
class _PrefillPart:
    token_start: int
    block_tables: torch.Tensor  # [Bp, max_blocks]
    cu_seqlens_q: torch.Tensor  # [Bp + 1], rebased to start at 0
    seq_lens: torch.Tensor  # [Bp]
    max_query_len: int


@dataclass
class _TritonStepState:
    decode: _DecodePart | None
    prefill: _PrefillPart | None


def _refuse_bidirectional(meta: AttentionMetadata) -> None:
    """Raise ``NotImplementedError`` when ``meta`` carries bidirectional image spans: the
    kernels' masks are causal only."""
    if meta.bidirectional:
        raise NotImplementedError(
            "the triton attention backend has causal masks only: image spans attended both "
            "ways need the torch attention backend (--attention-backend torch)")


class TritonAttentionBackend:
    name = "triton"

    def prepare(self, meta: AttentionMetadata) -> None:
        _refuse_bidirectional(meta)
        nd = meta.num_decodes
        decode = prefill = None
        if nd:
            decode = _DecodePart(
                num_tokens=meta.num_decode_tokens,
                block_tables=meta.block_tables[:nd],
                seq_lens=meta.seq_lens[:nd],
                max_seq_len=max(meta.seq_lens_cpu[:nd]),
                num_splits=meta.decode_num_splits,
            )
        if meta.num_seqs > nd:
            cu = meta.cu_seqlens_q[nd:]
            prefill = _PrefillPart(
                token_start=meta.num_decode_tokens,
                block_tables=meta.block_tables[nd:],
                cu_seqlens_q=cu - meta.num_decode_tokens if nd else cu,
                seq_lens=meta.seq_lens[nd:],
                max_query_len=max(meta.query_lens_cpu[nd:]),
            )
        meta.backend_state["triton"] = _TritonStepState(decode=decode, prefill=prefill)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int | None,
                kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Store this step's K/V (quantised into an 8-bit or int4 pool), then attend; returns a
        fresh contiguous ``[T, H, D]``. ``softcap`` (Gemma 2): scores soft-capped in the
        kernels."""
        _refuse_bidirectional(meta)
        state: _TritonStepState = meta.backend_state["triton"]
        int4 = kv_quant_kind(k_cache) == 3
        v_smooth = None
        if int4:  # the pool and the kernels live in the rotated basis (module docstring)
            k, v = k.float(), v.float()
            if kv_scales is not None:  # calibrated per-channel smoothing [KVH, D] (keys only)
                k_smooth, v_smooth = kv_scales
                group = q.shape[1] // k.shape[1]
                k = k / k_smooth
                q = q * k_smooth.repeat_interleave(group, dim=0).to(q.dtype)
                if v_smooth is not None:
                    v = v / v_smooth
                    v_smooth = v_smooth.repeat_interleave(group, dim=0).to(q.dtype)
            k, v, q = int4_rotate(k), int4_rotate(v), int4_rotate(q)
            kv_scales = None  # int4 rows carry their own scales
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if state.decode is not None:
            dec = state.decode
            paged_decode_attention(
                q[:dec.num_tokens], k_cache, v_cache, dec.block_tables, dec.seq_lens, scale,
                num_splits=dec.num_splits, sliding_window=sliding_window,
                max_seq_len=dec.max_seq_len, out=out[:dec.num_tokens], kv_scales=kv_scales,
                softcap=softcap)
        if state.prefill is not None:
            pre = state.prefill
            paged_attention(
                q[pre.token_start:], k_cache, v_cache, pre.block_tables, pre.cu_seqlens_q,
                pre.seq_lens, scale, sliding_window, max_query_len=pre.max_query_len,
                out=out[pre.token_start:], kv_scales=kv_scales, softcap=softcap)
        if not int4:
            return out
        out = int4_rotate(out)
        return out if v_smooth is None else out * v_smooth
