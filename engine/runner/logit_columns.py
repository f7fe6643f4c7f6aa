"""Sampled rows' logits computed only where a grammar allows tokens.

A constrained row's logits are -inf outside the tokens its grammar allows before anything reads
them (masking comes before penalties, temperature and logprobs). Where the grammar allows few
tokens (a forced key or separator, an enum, a number's digits), projecting onto the whole
vocabulary computes logits that are thrown away. ``restricted_logits`` computes those rows'
logits for the allowed columns only and leaves the rest at -inf: the numbers the full head and
the mask give together, bit for bit (the head computes the columns with the same kernel and
arithmetic, ``LlamaForCausalLM.compute_logits_columns``; a head that cannot promise that
declines, and the step takes the full head).

The engine hands the runner a :class:`SampleColumns` per step; ``columns()`` is called after
the forward pass, so a bitmask filled on a worker thread during the pass is waited for only
then."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

# The restricted rows' allowed columns together must be at most this share of the vocabulary,
# or the step takes the full head: gathering and computing more costs about what it saves.
MAX_UNION_FRACTION = 0.25


class SampleColumns(Protocol):
    """Per sampled row of a step (the runner's row order): the vocabulary columns it may take
    (a sorted int64 tensor, below ``width``), or None for a row that needs every column.
    Columns at or above ``width`` (a model vocabulary padded past the grammar's) are not the
    grammar's to forbid and are computed for every row."""

    width: int

    def columns(self) -> Sequence[torch.Tensor | None]: ...


class HeadColumns(Protocol):
    """What ``restricted_logits`` needs of a model."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def compute_logits_columns(self, hidden: torch.Tensor,
                               columns: torch.Tensor) -> torch.Tensor | None: ...


def restricted_logits(model: HeadColumns, hidden: torch.Tensor, vocab_width: int,
                      sample_columns: SampleColumns | None) -> tuple[torch.Tensor, list[int]]:
    """``[rows, vocab_width]`` float32 logits of ``hidden``'s rows, and the rows computed only
    at their allowed columns (-inf elsewhere; their masks need not be applied again). The full head
    serves every row when nothing is restricted, the restricted columns together are too many,
    or the model declines."""
    cols = list(sample_columns.columns()) if sample_columns is not None else []
    sparse = [i for i, c in enumerate(cols) if c is not None]
    if not sparse:
        return model.compute_logits(hidden), []
    if len(cols) != hidden.shape[0]:
        raise ValueError(f"{len(cols)} column sets for {hidden.shape[0]} sampled rows")
    union = torch.unique(torch.cat([cols[i] for i in sparse]))
    width = min(sample_columns.width, vocab_width)
    pad = torch.arange(width, vocab_width, dtype=torch.int64)
    union = torch.cat([union[union < width], pad])
    if union.numel() > MAX_UNION_FRACTION * vocab_width:
        return model.compute_logits(hidden), []
    sub = model.compute_logits_columns(hidden[sparse], union)
    if sub is None:
        return model.compute_logits(hidden), []
    out = torch.full((hidden.shape[0], vocab_width), float("-inf"), dtype=torch.float32,
                     device=hidden.device)
    dense = [i for i, c in enumerate(cols) if c is None]
    if dense:
        out[dense] = model.compute_logits(hidden[dense])
    for k, i in enumerate(sparse):
        mine = torch.cat([cols[i][cols[i] < width], pad])
        out[i, mine] = sub[k, torch.searchsorted(union, mine)]
    return out, sparse
