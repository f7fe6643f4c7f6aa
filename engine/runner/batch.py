"""Flattening one step's plan (``engine.step.plan.StepPlan``) into the model's packed input.

Private to the runner (``engine.runner.protocol``): the core never sees this layout; the
runner maps its rows back to the plan's chunks in its ``StepOutput``.

Plain data in, plain data out: this module sees neither sequences nor the KV manager. Every
sequence's new tokens sit side by side in one ``[T]`` batch (no padding), decodes first.
Python work here is O(sequences + blocks); per-token indices (positions, slots) are computed
with tensor ops, except in a decode-only step (one token per sequence), where a few Python ints
are cheaper than the tensor indexing (docs/decisions.md#decode-only-step-indices).
Everything in a :class:`ModelInput` is host (CPU) data: the model runner moves it to its device
in one copy (``engine.runner.device_input``), or into a captured CUDA graph's static buffers
(``engine.runner.cuda_graphs``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.step.output import PromptLogitRows
from engine.step.plan import StepPlan
from engine.vision.embedder import ImageRows


@dataclass
class ModelInput:
    """One step's packed batch, host tensors only.

    ``block_tables`` is ``[B, max_blocks]`` int32 padded with 0 beyond each sequence's
    ``ceil(seq_len / block_size)`` blocks; ``slot_mapping`` has no -1 entries.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    query_lens: list[int]
    seq_lens_list: list[int]
    num_decodes: int  # leading sequences with one new token
    sample_indices: torch.Tensor  # [S] int64 flat token rows whose logits are sampled
    sample_seq_indices: list[int]  # the scheduled entries that sample, in row order
    # Sampled rows of each of those entries (1, or 1 + its draft when speculating): entry
    # ``sample_seq_indices[i]`` owns the next ``sample_counts[i]`` rows of the sampled logits.
    sample_counts: list[int]
    prompt_indices: torch.Tensor  # [P] int64 flat rows needing prompt logits
    prompt_targets: torch.Tensor  # [P] int64 the prompt token each of those rows predicts
    prompt_top_k: int  # the largest prompt_logprobs k among those rows (0 if none)
    prompt_rows: list[PromptLogitRows]
    # Hybrid KV cache: block tables and slots of KV groups 1.. (group 0's are the above).
    extra_block_tables: tuple[torch.Tensor, ...] = ()
    extra_slot_mappings: tuple[torch.Tensor, ...] = ()
    # Pooling chunks (``SeqChunk.pool``): (chunk index, first flat row, end flat row, head ids)
    pool_rows: tuple[tuple[int, int, int, tuple[int, ...]], ...] = ()
    # Each sequence's LoRA slot (-1: base); empty when no chunk runs under an adapter.
    lora_slots: tuple[int, ...] = ()
    # Image placeholders computed this step (their rows take the encoder's embeddings) and
    # the spans they attend both ways: (sequence index, first, end) positions.
    image_rows: tuple[ImageRows, ...] = ()
    bidirectional: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence decodes one token and only sampled rows need logits."""
        return (self.num_decodes == self.num_seqs and not self.prompt_rows and not self.pool_rows
                and not self.image_rows)


def build_model_input(plan: StepPlan) -> ModelInput:
    """Pack ``plan`` (at least one sequence) into one flat host batch, rows in plan order."""
    bs = plan.block_size
    ids: list[int] = []
    q_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    sample_seq_indices: list[int] = []
    sample_counts: list[int] = []
    num_draft_rows = 0
    prompt_rows: list[PromptLogitRows] = []
    prompt_flat: list[int] = []
    prompt_targets: list[int] = []
    prompt_top_k = 0
    num_decodes = 0
    pool_rows: list[tuple[int, int, int, tuple[int, ...]]] = []
    image_rows: list[ImageRows] = []
    spans: list[tuple[int, int, int]] = []
    for i, s in enumerate(plan.seqs):
        start, n = s.start, len(s.token_ids)
        if n == 1 and num_decodes == i:
            num_decodes += 1
        flat_start = len(ids)
        ids.extend(s.token_ids)
        q_lens.append(n)
        seq_lens.append(start + n)
        tables.append(s.block_table)
        if s.sample:
            sample_seq_indices.append(i)
            sample_counts.append(s.num_draft + 1)
            if s.num_draft:
                num_draft_rows += s.num_draft
        if s.pool is not None:
            p = s.pool
            pool_rows.append((i, flat_start + p.first - start, flat_start + p.last - start,
                              p.head_token_ids))
        for image in s.images:  # the chunk's rows among the image's placeholders
            lo, hi = max(start, image.offset), min(start + n, image.end)
            image_rows.append(ImageRows(flat_start + lo - start, image, lo - image.offset,
                                        hi - lo))
            spans.append((i, image.offset, image.end))
        span = s.prompt_logits
        if span is not None:
            first, last = span.first, span.last
            row_start = len(prompt_flat)
            prompt_flat.extend(range(flat_start + first - start, flat_start + last - start))
            prompt_targets.extend(span.targets)
            prompt_rows.append(PromptLogitRows(i, row_start, len(prompt_flat), first + 1))
            prompt_top_k = max(prompt_top_k, span.top_k)

    block_tables = _pad_tables(tables)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens_t, 0, out=cu[1:])
    num_tokens = len(ids)
    groups = len(plan.seqs[0].extra_tables)  # hybrid KV cache: groups 1.. (0 is the above)
    group_tables = [[s.extra_tables[g] for s in plan.seqs] for g in range(groups)]
    extra_tables = tuple(_pad_tables(t) for t in group_tables)
    if num_decodes == len(q_lens):  # decode only: one token per sequence, indexed in Python
        last = [n - 1 for n in seq_lens]  # (a handful of ints: cheaper than tensor indexing)
        positions = torch.tensor(last, dtype=torch.int64)
        slots = _decode_slots(tables, last, bs)
        extra_slots = tuple(_decode_slots(t, last, bs) for t in group_tables)
    else:
        seq_idx = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
        positions = (torch.arange(num_tokens) - cu[seq_idx] + (seq_lens_t - q_lens_t)[seq_idx])
        slots = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
        extra_slots = tuple(t[seq_idx, positions // bs].long() * bs + positions % bs
                            for t in extra_tables)
    ends = cu[1:][torch.tensor(sample_seq_indices, dtype=torch.int64)]
    if num_draft_rows:  # speculating chunks sample their last num_draft + 1 rows
        counts = torch.tensor(sample_counts, dtype=torch.int64)
        offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts)
        sample_indices = torch.repeat_interleave(ends - counts, counts) + offsets
    else:
        sample_indices = ends - 1
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu.to(torch.int32),
        seq_lens=seq_lens_t.to(torch.int32),
        block_tables=block_tables,
        block_size=bs,
        query_lens=q_lens,
        seq_lens_list=seq_lens,
        num_decodes=num_decodes,
        sample_indices=sample_indices,
        sample_seq_indices=sample_seq_indices,
        sample_counts=sample_counts,
        prompt_indices=torch.tensor(prompt_flat, dtype=torch.int64),
        prompt_targets=torch.tensor(prompt_targets, dtype=torch.int64),
        prompt_top_k=prompt_top_k,
        prompt_rows=prompt_rows,
        extra_block_tables=extra_tables,
        extra_slot_mappings=extra_slots,
        pool_rows=tuple(pool_rows),
        lora_slots=(tuple(s.lora_slot for s in plan.seqs)
                    if any(s.lora_slot >= 0 for s in plan.seqs) else ()),
        image_rows=tuple(image_rows),
        bidirectional=tuple(spans),
    )


def _decode_slots(tables: list[list[int]], positions: list[int], bs: int) -> torch.Tensor:
    """The slot of each sequence's one new token, as the tensor path computes it from the
    padded tables (an entry released outside a window, -1, reads as block 0)."""
    return torch.tensor([max(t[p // bs], 0) * bs + p % bs for t, p in zip(tables, positions)],
                        dtype=torch.int64)


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """``[B, max_blocks]`` int32, padded with 0. Entries released outside a sliding window
    (-1) read as block 0: any valid block does, the kernels mask those positions."""
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32).clamp_(min=0)
