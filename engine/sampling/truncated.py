"""Top-k / top-p sampling drawn among a row's candidates, without a pass over the vocabulary
for the softmax, the cumulative sum and the masked copy.

The sampler's general path (engine/sampling/sampler.py) copies the logits, divides them by
the temperature, masks each full row to -inf outside top-k / top-p / min-p, takes the softmax
and the cumulative sum over the whole row and searches it for ``(1 - u) x total``: five
passes and three row-sized temporaries (each a fresh allocation that faults its pages in). When every row keeps only part of its vocabulary
(top-k below the vocabulary, or a top-p whose nucleus lies within the row's largest
candidates, as it almost always does for a language model) all of that happens within the
candidates: the same masks (top-k keeps what ties the k-th candidate; top-p the smallest
prefix of the candidates, largest first, whose mass over the WHOLE row reaches p; min-p
against the largest kept), the softmax over the kept candidates, and the inverse CDF over
them in vocabulary order, with the same uniform ``u``: the same distribution and the same
token as the general path except where ``u`` falls within float rounding of a boundary
between two tokens' cumulative sums (the sums are taken over fewer terms). A row whose
candidates hold less than its top-p of the mass returns ``None`` for the whole batch: the
general path (a full sort) serves it. ``PYTHONPATH=. python benchmarks/sampling_cost.py``
measures both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.candidates import top_candidates
from engine.sampling.row import SamplingRow

# The nucleus of a language model almost always lies within its few hundred most likely
# tokens: top-p looks there first (the general path too).
NUCLEUS_CANDIDATES = 512


def truncates(rows: Sequence[SamplingRow], vocab: int) -> bool:
    """Whether every row keeps only part of the vocabulary (top-k below it, or top-p < 1)."""
    return all(0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in rows)


def sample_truncated(x: torch.Tensor, rows: Sequence[SamplingRow],
                     u: torch.Tensor) -> torch.Tensor | None:
    """One token per row of ``x`` (float32 logits after the processors, before the
    temperature; not changed; rows all ``truncates``), drawn by the uniforms ``u``; None when
    some top-p row's nucleus is not among its candidates (module docstring). The temperature
    divides the candidates only (the same floats as dividing the row, then selecting), and
    the whole rows of top-p rows without top-k (their mass)."""
    rows_n, vocab = x.shape
    dev = x.device
    ks_list = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    # a top-k row needs its k candidates; a top-p row without one, NUCLEUS_CANDIDATES
    n = min(vocab, max(k if k < vocab else NUCLEUS_CANDIDATES for k in ks_list))
    temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype,
                         device=dev).unsqueeze(1)
    vals, order = top_candidates(x, n)
    vals.div_(temps)
    ks = torch.tensor(ks_list, dtype=torch.long, device=dev)
    top_k = ks < vocab
    kth = vals.gather(1, (ks.clamp(max=n) - 1).unsqueeze(1))
    vals.masked_fill_((vals < kth) & top_k.unsqueeze(1), float("-inf"))
    # Top-p's mass: within the top-k for top-k rows, over the whole row for the others.
    lse = torch.logsumexp(vals, dim=-1)
    for i in (~top_k).nonzero().flatten().tolist():  # a row at a time: one row's temporary
        lse[i] = torch.logsumexp(x[i] / temps[i], dim=-1)
    probs = (vals - lse.unsqueeze(1)).exp_()
    cum = probs.cumsum(dim=-1)
    ps = torch.tensor([r.params.top_p for r in rows], dtype=x.dtype, device=dev)
    if bool(((~top_k) & (cum[:, -1] < ps)).any()):
        return None  # a nucleus beyond the candidates: the general path's full sort
    # The first candidate always stays (nothing before it); p = 1 keeps everything.
    ps = torch.where(ps < 1.0, ps, torch.inf)
    vals.masked_fill_(cum - probs >= ps.unsqueeze(1), float("-inf"))
    mins = [r.params.min_p for r in rows]
    if any(m > 0.0 for m in mins):  # below min_p x the largest kept probability
        ratio = (vals - vals[:, :1]).exp_()
        floor = torch.tensor(mins, dtype=x.dtype, device=dev).unsqueeze(1)
        vals.masked_fill_(ratio < floor, float("-inf"))
    # The inverse CDF over the kept candidates in vocabulary order, as over the masked row.
    ids, perm = order.sort(dim=-1)
    cdf = torch.softmax(vals, dim=-1).gather(1, perm).cumsum_(dim=-1)
    target = ((1.0 - u) * cdf[:, -1]).unsqueeze(1)
    at = torch.searchsorted(cdf, target).clamp_(max=n - 1)
    return ids.gather(1, at).squeeze(1)
