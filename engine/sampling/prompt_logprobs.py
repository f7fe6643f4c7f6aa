"""Prompt logprobs, reduced chunk by chunk so that memory is bounded by the chunk, not the prompt.

A prompt position's entry is the logprob and rank of the next prompt token under the model's
raw distribution (``log_softmax`` of the logits), plus the ``k`` most likely tokens; ``rank = 1
+ #tokens with a strictly higher logprob`` (as for sampled tokens, ``engine.sampling.sampler``).

``prompt_logprobs_in_chunks`` computes the logits of at most ``PROMPT_LOGPROB_CHUNK`` rows at a
time and keeps only their reduction (``[rows]`` target logprobs and ranks, ``[rows, k]`` top-k):
an 8k-token prompt with ``echo`` and ``logprobs`` never holds ``[8192, vocab]`` float32 logits.
The model runner calls it inside the step (device tensors); the engine turns the host result
into per-position dicts with ``position_entries``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.request_output import Logprob

# Rows of logits alive at once. 512 x a 152k vocabulary is ~300 MB of float32 per buffer.
PROMPT_LOGPROB_CHUNK = 512


@dataclass
class PromptLogprobs:
    """Reduced logprobs of ``P`` rows; row ``j`` predicts ``targets[j]``."""

    target_logprobs: torch.Tensor  # [P] float32
    ranks: torch.Tensor  # [P] int64
    top_ids: torch.Tensor  # [P, K] int64, most likely first (K: the step's largest k)
    top_logprobs: torch.Tensor  # [P, K] float32

    @property
    def num_rows(self) -> int:
        return int(self.target_logprobs.shape[0])

    def to(self, device: torch.device | str) -> PromptLogprobs:
        return PromptLogprobs(self.target_logprobs.to(device), self.ranks.to(device),
                              self.top_ids.to(device), self.top_logprobs.to(device))


def reduce_logits(logits: torch.Tensor, targets: torch.Tensor, k: int) -> PromptLogprobs:
    """The reduction of ``logits [R, V]`` for ``targets [R]`` (same device) and top-``k``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = lp.gather(1, targets.unsqueeze(1))
    ranks = (lp > tgt).sum(dim=-1) + 1
    k = min(k, lp.shape[1])
    if k > 0:
        vals, ids = lp.topk(k, dim=-1)
    else:
        vals = lp.new_empty((lp.shape[0], 0))
        ids = torch.empty((lp.shape[0], 0), dtype=torch.long, device=lp.device)
    return PromptLogprobs(tgt.squeeze(1), ranks, ids, vals)


def prompt_logprobs_in_chunks(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                              hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
                              k: int, chunk: int = PROMPT_LOGPROB_CHUNK) -> PromptLogprobs:
    """Reduced prompt logprobs of ``hidden[rows]`` (``targets`` per row), ``chunk`` rows of
    logits at a time; the result is on the host. Peak extra memory: one chunk's logits and
    their ``log_softmax`` (``2 * chunk * vocab`` floats) plus the small reductions."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    parts = []
    for i in range(0, int(rows.shape[0]), chunk):
        logits = compute_logits(hidden[rows[i:i + chunk]])
        parts.append(reduce_logits(logits, targets[i:i + chunk], k))
        del logits
    if not parts:
        empty = torch.empty(0)
        return PromptLogprobs(empty, empty.long(), torch.empty((0, 0), dtype=torch.long),
                              torch.empty((0, 0)))
    out = PromptLogprobs(*(torch.cat([getattr(p, f) for p in parts]) for f in
                           ("target_logprobs", "ranks", "top_ids", "top_logprobs")))
    return out.to("cpu")


def position_entries(pl: PromptLogprobs, start: int, end: int, target_ids: Sequence[int],
                     k: int, token_text: Callable[[int], str] | None = None,
                     ) -> list[dict[int, Logprob]]:
    """Per-position dicts for rows ``[start, end)`` of ``pl`` (host), whose targets are
    ``target_ids``: the target's ``Logprob`` plus the ``k`` most likely tokens, each ranked."""
    if end - start != len(target_ids):
        raise ValueError(f"{end - start} rows for {len(target_ids)} targets")
    if start == end:
        return []
    tgt_lp = pl.target_logprobs[start:end].tolist()
    ranks = pl.ranks[start:end].tolist()
    k = min(k, pl.top_ids.shape[1])
    ids = pl.top_ids[start:end, :k].tolist()
    vals = pl.top_logprobs[start:end, :k].tolist()
    out: list[dict[int, Logprob]] = []
    for j, tok in enumerate(target_ids):
        entry = {tok: Logprob(tgt_lp[j], ranks[j], token_text(tok) if token_text else None)}
        add_top_entries(entry, list(zip(ids[j], vals[j], strict=True)), token_text)
        out.append(entry)
    return out


def add_top_entries(entry: dict[int, Logprob], top: list[tuple[int, float]],
                    token_text: Callable[[int], str] | None) -> None:
    """Add top-k entries whose ranks follow the same strict rule as the chosen token's.

    Every token with a strictly higher logprob than a top-k member is itself in the top-k, so
    counting within the list gives the exact rank.
    """
    for tok, lp in top:
        if tok not in entry:
            rank = 1 + sum(1 for _, other in top if other > lp)
            entry[tok] = Logprob(lp, rank, token_text(tok) if token_text else None)
