"""The step output: what the model runner hands back for one ``engine.step.plan.StepPlan``.

Indexed by the plan's chunks (``plan.seqs[i]``), not by how the runner packed them: the core
maps results to sequences through chunk indices alone and never sees the packed batch
(``engine.runner.batch``). Tensors stay where the runner made them (its device); the prompt
logprobs are already reduced on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.prompt_logprobs import PromptLogprobs


@dataclass(frozen=True, slots=True)
class PromptLogitRows:
    """One chunk's rows of a step's reduced prompt logprobs."""

    # The chunk of the plan (plan.seqs[seq_index]).
    seq_index: int
    # First row of prompt_logprobs that belongs to the chunk.
    row_start: int
    # One past its last row.
    row_end: int
    # The prompt token the first row predicts; row r predicts first_target + (r - row_start).
    first_target: int


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One step's results. A plan with no chunks (block moves only) gives the empty output."""

    # One (chunk index, rows) pair per chunk whose sample is set, in plan order; rows are that
    # chunk's rows of sample_logits (one, or 1 + num_draft when it speculates: row j verifies
    # draft token j, the last one gives the token after the whole draft).
    sampled: tuple[tuple[int, range], ...] = ()
    # [sum of the rows, vocab] float32 on the runner's device (no rows when no chunk samples;
    # None for a plan without chunks).
    sample_logits: torch.Tensor | None = None
    # One entry per chunk whose prompt logprobs were computed: its rows of prompt_logprobs.
    prompt_rows: tuple[PromptLogitRows, ...] = ()
    # The step's prompt logprobs, reduced on the host (None when no chunk asked for them).
    prompt_logprobs: PromptLogprobs | None = None
    # Rows of sample_logits computed only at the columns their grammar allows (-inf
    # elsewhere: their masks need not be applied again); engine/runner/logit_columns.py.
    restricted_rows: tuple[int, ...] = ()
    # Pooling chunks (SeqChunk.pool): (chunk index, float32 vector on the host), the sum of
    # the span's final-norm hidden states, or its head logits.
    pooled: tuple[tuple[int, torch.Tensor], ...] = ()

    def __post_init__(self) -> None:
        rows = sum(len(r) for _, r in self.sampled)
        have = 0 if self.sample_logits is None else int(self.sample_logits.shape[0])
        if rows != have:
            raise ValueError(f"step output: the sampled chunks own {rows} rows, the sampled "
                             f"logits have {have}")
        if bool(self.prompt_rows) != (self.prompt_logprobs is not None):
            raise ValueError("step output: prompt rows and prompt logprobs come together")

    def logits(self, chunk: int) -> torch.Tensor:
        """The sampled logits rows of chunk ``chunk`` (``[1 + num_draft, vocab]``); KeyError
        when that chunk does not sample."""
        for i, rows in self.sampled:
            if i == chunk:
                return self.sample_logits[rows.start:rows.stop]
        raise KeyError(f"chunk {chunk} of the plan does not sample")
