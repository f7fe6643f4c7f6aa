"""Attention metadata and the backend contract: where model code meets the paged KV cache.

Every backend (``torch``: torch_backend.py, ``triton``: triton_backend.py; chosen by
``engine.attention.backend``): ``prepare(meta)`` runs once per step before the first layer and
may cache derived tensors on ``meta.backend_state``, never touching the KV pools;
``forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window, kv_scales=None)`` first writes
the step's new keys/values into their slots (``meta.slot_mapping``; slot -1 skipped), quantised
per the pool's format (``engine/kv_format/formats.py``; ``kv_scales`` the layer's fp8 per-head
scales, None meaning 1.0), then returns ``[T, H, D]`` where token ``i`` of sequence ``b`` attends
causally to keys ``0 .. pos`` of that sequence, ``pos = seq_lens[b] - q_len[b] + i``, and, when
``pos`` lies in an image span of ``meta.bidirectional``, to every key of that span (later ones
included), restricted to the last ``sliding_window`` keys when set (Triton refuses spans).
Hybrid KV cache: the step's metadata is group 0's, and ``layer_metas[i]`` the one layer ``i``
attends with (:meth:`AttentionMetadata.for_layer`); backends are unchanged. Sequences are
ordered decodes first (``q_len == 1``), then prefills/chunks; ``meta.num_decodes`` says how many
decodes lead."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat token batch, built once by the model runner.

    Tensors live on the model's device. ``block_tables`` is ``[B, max_blocks]`` int32, padded
    with 0 beyond each sequence's ``ceil(seq_len / block_size)`` blocks.
    """

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, keys per sequence including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # leading sequences with q_len == 1
    num_decode_tokens: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # True when no slot is -1 (known on the host; spares backends a device check). None: unknown.
    all_slots_valid: bool | None = None
    # Fixed split count for the decode kernel (CUDA-graph buckets); None: the kernel chooses.
    decode_num_splits: int | None = None
    backend_state: dict[str, Any] = field(default_factory=dict)
    # Hybrid KV cache: per layer, the metadata of its group (None: one group, this one).
    layer_metas: list[AttentionMetadata] | None = None
    # Image spans attended both ways (Gemma 3): (sequence index b, first, end) with key
    # positions; a query of sequence b at a position in [first, end) also attends to every
    # key of [first, end), later ones included (within a sliding window's reach as well:
    # mask = window AND (causal OR span)). The scheduler never splits a span across steps,
    # so every key of a span a query sits in is in the pool or in this step.
    bidirectional: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` attends with (``self`` unless the KV cache is hybrid)."""
        return self if self.layer_metas is None else self.layer_metas[layer]


def with_group_tables(meta: AttentionMetadata, slot_mappings: list[torch.Tensor],
                      block_tables: list[torch.Tensor],
                      layer_group: tuple[int, ...]) -> list[AttentionMetadata]:
    """Give ``meta`` (group 0's) per-layer metadata for a hybrid KV cache: groups ``1..`` take
    ``slot_mappings[g - 1]`` and ``block_tables[g - 1]``. Returns the new groups' metadata
    (each needs ``backend.prepare``)."""
    groups = [meta] + [
        AttentionMetadata(
            slot_mapping=s, cu_seqlens_q=meta.cu_seqlens_q, seq_lens=meta.seq_lens,
            block_tables=t, block_size=meta.block_size, max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len, num_decodes=meta.num_decodes,
            num_decode_tokens=meta.num_decode_tokens, query_lens_cpu=meta.query_lens_cpu,
            seq_lens_cpu=meta.seq_lens_cpu, all_slots_valid=meta.all_slots_valid,
            decode_num_splits=meta.decode_num_splits, bidirectional=meta.bidirectional)
        for s, t in zip(slot_mappings, block_tables)]
    meta.layer_metas = [groups[g] for g in layer_group]
    return groups[1:]


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...
