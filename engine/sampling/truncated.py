"""Top-k / top-p sampling drawn among a row's candidates, without a pass over the vocabulary
for the softmax, the cumulative sum and the masked copy.

When every row keeps only part of its vocabulary (top-k below the vocabulary, or a top-p whose
nucleus lies within the row's largest candidates) the sampler's general path
(engine/sampling/sampler.py) runs within the candidates: the same masks (top-k keeps what ties
the k-th candidate; top-p the smallest prefix of the candidates, largest first, whose mass over
the WHOLE row reaches p; min-p against the largest kept), the softmax over the kept candidates,
and the inverse CDF over them in vocabulary order, with the same uniform ``u``: the same
distribution and the same token as the general path except where ``u`` falls within float
rounding of a boundary between two tokens' cumulative sums. A row whose candidates hold less
than its top-p of the mass returns ``None`` for the whole batch: the general path (a full sort)
serves it. Figures: docs/decisions.md#top-k--top-p-sampling-within-the-candidates."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.candidates import top_candidates
from engine.sampling.row import SamplingRow

# The nucleus of a language model almost always lies within its few dozen most likely tokens,
# nearly always within a few hundred: a top-p row without top-k looks among its NUCLEUS_FIRST
# largest logits, then its NUCLEUS_CANDIDATES largest (the general path's first look), then
# the general path sorts the row.
NUCLEUS_FIRST = 64
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
    vocab = x.shape[1]
    dev = x.device
    ks_list = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype,
                         device=dev).unsqueeze(1)
    ks = torch.tensor(ks_list, dtype=torch.long, device=dev)
    ps = torch.tensor([r.params.top_p for r in rows], dtype=x.dtype, device=dev)
    # Top-p's mass: within the top-k for top-k rows, over the whole row for the others.
    whole = torch.full((len(rows),), float("nan"), dtype=x.dtype, device=dev)
    for i, k in enumerate(ks_list):
        if k == vocab:  # a row at a time: one row's temporary
            whole[i] = torch.logsumexp(x[i] / temps[i], dim=-1)
    kept = None
    for look in (NUCLEUS_FIRST, NUCLEUS_CANDIDATES):
        # a top-k row needs its k candidates; a top-p row without one, ``look``
        n = min(vocab, max(k if k < vocab else look for k in ks_list))
        kept = _nucleus_among(x, n, temps, ks, ps, whole)
        if kept is not None or n == vocab or all(k < vocab for k in ks_list):
            break
    if kept is None:
        return None  # a nucleus beyond the candidates: the general path's full sort
    vals, order = kept
    mins = [r.params.min_p for r in rows]
    if any(m > 0.0 for m in mins):  # below min_p x the largest kept probability
        ratio = (vals - vals[:, :1]).exp_()
        floor = torch.tensor(mins, dtype=x.dtype, device=dev).unsqueeze(1)
        vals.masked_fill_(ratio < floor, float("-inf"))
    # The inverse CDF over the kept candidates in vocabulary order, as over the masked row.
    ids, perm = order.sort(dim=-1)
    cdf = torch.softmax(vals, dim=-1).gather(1, perm).cumsum_(dim=-1)
    return ids.gather(1, inverse_cdf(cdf, u).unsqueeze(1)).squeeze(1)


def _nucleus_among(x: torch.Tensor, n: int, temps: torch.Tensor, ks: torch.Tensor,
                   ps: torch.Tensor, whole: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``n`` largest logits of each row divided by its temperature, with -inf outside its
    top-k and then its top-p (``whole``: the log of a row's total mass where it has no top-k),
    and their indices; None when a top-p row without top-k needs more than ``n``."""
    vals, order = top_candidates(x, n)
    vals.div_(temps)
    if bool(mask_candidates(vals, ks, ps, x.shape[1], whole).any()):
        return None
    return vals, order


def mask_candidates(vals: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, vocab: int,
                    whole: torch.Tensor) -> torch.Tensor:
    """Set to -inf (in place) the candidates ``vals`` ([rows, n], largest first, temperature
    applied) outside each row's top-k (``ks``; ``vocab``: none), then outside its top-p
    (``ps``): the smallest prefix whose mass reaches p, the mass within the top-k for a top-k
    row, else over the whole row (``whole``: the log of its total). Returns the rows (bool)
    whose candidates hold less than their top-p: their nucleus may extend beyond them."""
    top_k = ks < vocab
    kth = vals.gather(1, (ks.clamp(max=vals.shape[1]) - 1).unsqueeze(1))
    vals.masked_fill_((vals < kth) & top_k.unsqueeze(1), float("-inf"))
    lse = torch.where(top_k, torch.logsumexp(vals, dim=-1), whole)
    probs = (vals - lse.unsqueeze(1)).exp_()
    cum = probs.cumsum(dim=-1)
    # The first candidate always stays (nothing before it). Rows here only for their top-k
    # keep their whole tail: rounding can push a float cumsum to 1.0 early.
    cut = torch.where(ps < 1.0, ps, torch.inf)
    vals.masked_fill_(cum - probs >= cut.unsqueeze(1), float("-inf"))
    return (~top_k) & (cum[:, -1] < ps)


def inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``cdf`` ([rows, n], non-decreasing), the first position whose value reaches
    ``(1 - u) x`` the row's total. With v = 1 - u in (0, 1], a position of zero probability is
    never it (its cdf equals its predecessor's, and v > 0 excludes a zero-probability first
    position); v <= 1 keeps it inside the row."""
    target = ((1.0 - u) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=cdf.shape[1] - 1)
