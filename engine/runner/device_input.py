"""Moving a step's host-side :class:`~engine.runner.batch.ModelInput` to the model's device.

On CUDA every integer tensor of the step is packed into one pinned host buffer and crosses to
the GPU in one asynchronous copy (eight small pageable copies cost eight synchronising
transfers). On other devices the host tensors are used as they are.

Contract: the pinned buffer is reused step after step; before it is overwritten, the event
recorded after the previous copy is waited on, so a copy still in flight is never clobbered.
The returned device tensors are views of one device buffer owned by the caller's step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.metadata import AttentionMetadata, with_group_tables
from engine.runner.batch import ModelInput

_ALIGN = 4  # int32 words: every packed tensor starts on a 16-byte boundary


@dataclass
class DeviceBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [S]
    prompt_indices: torch.Tensor  # [P]
    prompt_targets: torch.Tensor  # [P]
    group_metas: list[AttentionMetadata] = field(default_factory=list)


class HostToDeviceStager:
    """Packs host tensors into one pinned buffer and copies it to ``device`` in one go."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # pinned int32 words
        self._done: torch.cuda.Event | None = None

    def _buffer(self, words: int) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()  # the previous copy has left the buffer
        if self._host is None or self._host.numel() < words:
            size = max(words, 2 * (0 if self._host is None else self._host.numel()), 4096)
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=True)
        return self._host

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device copies of ``tensors`` (int32 / int64, any shape), in one transfer."""
        if self.device.type != "cuda":
            return [t.to(self.device) for t in tensors]
        layout = []
        words = 0
        for t in tensors:
            per = t.element_size() // 4
            if t.element_size() not in (4, 8):
                raise ValueError(f"only 32/64-bit integer tensors are staged; got {t.dtype}")
            layout.append((words, t.numel() * per))
            words += -(-(t.numel() * per) // _ALIGN) * _ALIGN
        host = self._buffer(words)
        for t, (off, n) in zip(tensors, layout):
            if n:
                host[off:off + n].view(t.dtype).copy_(t.reshape(-1))
        dev = host[:words].to(self.device, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        return [dev[off:off + n].view(t.dtype).view(t.shape) if n else
                torch.empty(t.shape, dtype=t.dtype, device=self.device)
                for t, (off, n) in zip(tensors, layout)]


def to_device(inp: ModelInput, stager: HostToDeviceStager,
              layer_group: tuple[int, ...] = ()) -> DeviceBatch:
    """``layer_group`` (hybrid KV cache): each layer's KV group; the metadata then carries
    every layer's (``AttentionMetadata.layer_metas``), and ``DeviceBatch.group_metas`` lists
    the groups' beyond group 0 (to prepare)."""
    extra = [*inp.extra_slot_mappings, *inp.extra_block_tables]
    ids, pos, slots, cu, lens, tables, sample, prompt, targets, *groups = stager.stage([
        inp.input_ids, inp.positions, inp.slot_mapping, inp.cu_seqlens_q, inp.seq_lens,
        inp.block_tables, inp.sample_indices, inp.prompt_indices, inp.prompt_targets, *extra])
    meta = AttentionMetadata(
        slot_mapping=slots, cu_seqlens_q=cu, seq_lens=lens, block_tables=tables,
        block_size=inp.block_size, max_query_len=max(inp.query_lens),
        max_seq_len=max(inp.seq_lens_list), num_decodes=inp.num_decodes,
        num_decode_tokens=inp.num_decodes, query_lens_cpu=inp.query_lens,
        seq_lens_cpu=inp.seq_lens_list, all_slots_valid=True, bidirectional=inp.bidirectional)
    group_metas: list[AttentionMetadata] = []
    if extra and layer_group:
        n = len(inp.extra_slot_mappings)
        group_metas = with_group_tables(meta, groups[:n], groups[n:], layer_group)
    return DeviceBatch(ids, pos, meta, sample, prompt, targets, group_metas)
