"""Verification of drafts against the target model: exact, for greedy and for sampling.

A speculating sequence's step computes logits at k+1 positions: row j follows the context plus
``draft[:j]``, and row j's ``SamplingRow`` carries the same history (``rows_for_draft``), so
processors see what the non-speculative step would. Greedy rows: the run is the longest prefix
of the draft equal to the rows' argmax targets, then the target of the first mismatch (or of
row k): identical to one token per step. Sampled rows (the standard rejection rule; an n-gram
draft is a point mass): with p_j the row's final distribution (``Sampler.target_probs``), d_j
is accepted with probability p_j(d_j); on the first rejection the token is drawn from p_j with
d_j removed and renormalised, and the run ends; if every draft is accepted a bonus token is
drawn from p_k. Each emitted token is distributed exactly as p_j given the emitted prefix.

Uniforms come from the row's own generator (seeded requests) or the sampler's shared CPU
generator; draws are on the host (one per verified position), the distributions stay on the
logits' device."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling.argmax import first_argmax
from engine.sampling.row import SamplingRow
from engine.sampling.sampler import Sampler, SamplerOutput, is_greedy


@dataclass(frozen=True)
class DraftRun:
    """One speculating sequence's rows: ``rows[j]`` for position j (``len(draft) + 1``)."""

    draft: tuple[int, ...]
    rows: tuple[SamplingRow, ...]


@dataclass(frozen=True)
class Verified:
    """What a sequence keeps: ``tokens`` (accepted drafts, then one token of the target's own)
    to append in order; ``row`` is the output row of ``tokens[0]`` (token i: row + i)."""

    tokens: tuple[int, ...]
    num_accepted: int
    row: int


def split_rows(sample_counts: Sequence[int],
               ) -> tuple[list[tuple[int, range]], list[tuple[int, range]]]:
    """Split a step's sampled logits rows (the row count of each sampling chunk of
    ``StepOutput.sampled``: 1 per plain sequence, 1 + its draft per speculating one) into
    ``(entry index, rows)`` pairs: plain, speculating."""
    plain: list[tuple[int, range]] = []
    spec: list[tuple[int, range]] = []
    row = 0
    for i, c in enumerate(sample_counts):
        (spec if c > 1 else plain).append((i, range(row, row + c)))
        row += c
    return plain, spec


def rows_for_draft(base: SamplingRow, draft: Sequence[int]) -> tuple[SamplingRow, ...]:
    """``base`` (the row of the pending position) and one row per draft token, row j seeing
    ``draft[:j]`` appended to the output so far. The generator and cache are shared."""
    out = [base]
    history = list(base.output_token_ids)
    for tok in draft:
        history.append(tok)
        out.append(dataclasses.replace(base, output_token_ids=list(history)))
    return tuple(out)


def verify(sampler: Sampler, logits: torch.Tensor, runs: Sequence[DraftRun],
           cpu_generator: torch.Generator) -> tuple[list[Verified], SamplerOutput]:
    """Verify every run; ``logits`` holds their rows back to back (``[sum(len(rows)), V]``).

    Returns one ``Verified`` per run and a ``SamplerOutput`` over all rows whose row ``i``
    reports the token emitted at that position (with logprobs where asked), for the rows
    that emitted one. ``cpu_generator`` serves the runs without a generator of their own.
    """
    rows = [r for run in runs for r in run.rows]
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, V]; got {tuple(logits.shape)}")
    greedy_idx = [i for i, r in enumerate(rows) if is_greedy(r.params)]
    sample_idx = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
    targets: dict[int, int] = {}
    if greedy_idx:
        g = torch.tensor(greedy_idx, dtype=torch.long, device=logits.device)
        sub = [rows[i] for i in greedy_idx]
        picks = first_argmax(sampler.processed(logits.index_select(0, g), sub)).tolist()
        targets = dict(zip(greedy_idx, picks, strict=True))
    probs_of: dict[int, int] = {}
    probs = None
    if sample_idx:
        s = torch.tensor(sample_idx, dtype=torch.long, device=logits.device)
        probs = sampler.target_probs(logits.index_select(0, s), [rows[i] for i in sample_idx])
        probs_of = {i: k for k, i in enumerate(sample_idx)}
    results: list[Verified] = []
    emitted = [0] * len(rows)
    row = 0
    for run in runs:
        draft = run.draft
        if is_greedy(run.rows[0].params):
            a = 0
            while a < len(draft) and draft[a] == targets[row + a]:
                a += 1
            tokens = (*draft[:a], targets[row + a])
        else:
            gen = run.rows[0].generator or cpu_generator
            tokens = _rejection(probs, [probs_of[row + j] for j in range(len(run.rows))],
                                draft, gen)
            a = len(tokens) - 1
        emitted[row:row + len(tokens)] = tokens
        results.append(Verified(tuple(tokens), a, row))
        row += len(run.rows)
    sampled = sampler.with_logprobs(logits, torch.tensor(emitted, dtype=torch.long,
                                                         device=logits.device), rows)
    return results, sampled


def _rejection(probs: torch.Tensor, idx: list[int], draft: Sequence[int],
               gen: torch.Generator) -> tuple[int, ...]:
    """The point-mass rejection rule over ``probs[idx[j]]`` (module docstring)."""
    out: list[int] = []
    for j, d in enumerate(draft):
        p = probs[idx[j]]
        if _uniform(gen) < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        out.append(_draw(residual, _uniform(gen), fallback=d))
        return tuple(out)
    out.append(_draw(probs[idx[len(draft)]], _uniform(gen), fallback=0))
    return tuple(out)


def _uniform(gen: torch.Generator) -> float:
    return float(torch.rand(1, generator=gen, device=gen.device)[0])


def _draw(p: torch.Tensor, u: float, fallback: int) -> int:
    """Inverse-CDF draw from the unnormalised ``p`` with ``u`` in [0, 1) (as the sampler:
    the first index whose cdf reaches (1 - u) * total; zero-mass tokens are never picked)."""
    cdf = p.cumsum(dim=0)
    total = float(cdf[-1])
    if not total > 0.0:
        return fallback
    target = torch.tensor([(1.0 - u) * total], dtype=cdf.dtype, device=cdf.device)
    return min(int(torch.searchsorted(cdf, target)[0]), p.shape[0] - 1)
