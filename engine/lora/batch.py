"""One step's rows by adapter slot: what the LoRA layers read while the model runs a step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class LoRABatch:
    """The rows of a packed batch that run under an adapter.

    ``row_slots``: every row's slot (-1: the base model), int32 on the device, for the
    one-call kernels (``lora_apply_``, ``kvserve_kernels.lora``); None when not asked for.
    ``groups`` (the matmul path; computed on first use): (slot, rows) for every slot with rows
    this step, rows as a ``slice`` when they are one run of the flat batch, else a LongTensor
    of row indices on the device."""

    seq_slots: tuple[int, ...]
    query_lens: tuple[int, ...]
    device: torch.device
    row_slots: torch.Tensor | None = None

    @staticmethod
    def build(seq_slots: Sequence[int], query_lens: Sequence[int], device: torch.device,
              row_slots: bool = False) -> LoRABatch | None:
        """From each packed sequence's slot (-1: base) and its row count; None when no row
        runs under an adapter."""
        if all(s < 0 for s in seq_slots):
            return None
        per_row = None
        if row_slots:
            per_row = torch.repeat_interleave(
                torch.tensor(list(seq_slots), dtype=torch.int32),
                torch.tensor(list(query_lens), dtype=torch.int64)).to(device, non_blocking=True)
        return LoRABatch(tuple(seq_slots), tuple(query_lens), device, per_row)

    @cached_property
    def groups(self) -> tuple[tuple[int, slice | torch.Tensor], ...]:
        runs: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for slot, n in zip(self.seq_slots, self.query_lens, strict=True):
            if slot >= 0:
                spans = runs.setdefault(slot, [])
                if spans and spans[-1][1] == row:
                    spans[-1] = (spans[-1][0], row + n)
                else:
                    spans.append((row, row + n))
            row += n
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, spans in runs.items():
            if len(spans) == 1:
                groups.append((slot, slice(*spans[0])))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in spans])
                groups.append((slot, idx.to(self.device, non_blocking=True)))
        return tuple(groups)
