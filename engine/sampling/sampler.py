"""Vectorised next-token sampling for one engine step.

``Sampler.__call__`` takes the logits of every row that samples this step and returns one token
per row, plus the raw-distribution logprobs the rows asked for. Per step: (1) logit processors
(``engine.sampling.penalties``), only on rows that use them; (2) greedy rows (temperature 0, or
top_k 1) take the argmax of the processed logits; (3) the other rows: temperature, top-k, top-p,
min-p, then inverse-CDF sampling (why: docs/decisions.md#top-k--top-p-sampling-within-the-candidates):
one uniform ``u`` per row picks the first token whose cumulative probability reaches ``u``. A
seeded row draws its ``u`` from its own generator, so its tokens depend only on its seed, its
logits and how many tokens it has drawn, in any batch; unseeded rows share the Sampler's
generator. When every sampled row truncates its vocabulary, all of this runs over the
candidates only (engine/sampling/truncated.py): the same distribution.

Logprobs are those of the model's raw distribution (``log_softmax`` of the logits as passed in,
before any processing: vLLM's default), and ``rank = 1 + #tokens with a strictly higher logprob``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.params.sampling import SamplingParams
from engine.request_output import Logprob
from engine.sampling import penalties
from engine.sampling.argmax import first_argmax
from engine.sampling.candidates import top_candidates
from engine.sampling.prompt_logprobs import add_top_entries
from engine.sampling.row import SamplingRow
from engine.sampling.truncated import (
    NUCLEUS_CANDIDATES,
    inverse_cdf,
    mask_candidates,
    sample_truncated,
    truncates,
)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # chosen token's raw logprob per row; None if nobody asked
    ranks: list[int] | None  # chosen token's rank per row; None if nobody asked
    top_logprobs: list[list[tuple[int, float]]] | None  # per row its top-k, [] if it didn't ask

    def position_logprobs(self, i: int, token_text: Callable[[int], str] | None = None,
                          ) -> dict[int, Logprob] | None:
        """Row ``i``'s entry for ``CompletionOutput.logprobs``: chosen token plus its top-k."""
        if self.logprobs is None or self.ranks is None or self.top_logprobs is None:
            return None
        tok = self.token_ids[i]
        entry = {tok: Logprob(self.logprobs[i], self.ranks[i],
                              token_text(tok) if token_text else None)}
        add_top_entries(entry, self.top_logprobs[i], token_text)
        return entry


def is_greedy(p: SamplingParams) -> bool:
    # top_k == 1 keeps only the argmax; routing it to the argmax makes it equal greedy exactly,
    # ties included.
    return p.greedy or p.top_k == 1


class Sampler:
    """Picks one token per row; holds the engine-wide generator used by unseeded rows."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V]; got "
                             f"{tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        greedy = [i for i, r in enumerate(rows) if is_greedy(r.params)]
        process = any(penalties.needs_processing(r) for r in rows)

        picked, u = None, None
        if not greedy and not process and truncates(rows, logits.shape[1]):
            u = self._uniforms(list(rows), logits.device, logits.dtype)
            picked = sample_truncated(logits, rows, u)  # None: the general path below
        if picked is not None:
            tokens = picked
        elif len(greedy) == len(rows) and not process:
            tokens = first_argmax(logits)
        else:
            x = logits.clone(memory_format=torch.contiguous_format)
            if process:
                penalties.apply_all(x, rows)
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if greedy:
                g_idx = torch.tensor(greedy, dtype=torch.long, device=logits.device)
                tokens.index_copy_(0, g_idx, first_argmax(x.index_select(0, g_idx)))
            sampled = [i for i in range(len(rows)) if not is_greedy(rows[i].params)]
            if len(sampled) == len(rows):  # x is this call's own copy: no second one
                tokens = self._sample(x, list(rows), u)
            elif sampled:
                s_idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
                picked = self._sample(x.index_select(0, s_idx), [rows[i] for i in sampled])
                tokens.index_copy_(0, s_idx, picked)
        return self._with_logprobs(logits, tokens, rows)

    # ---- for speculative verification (engine.spec_decode.verifier) ----------------------

    def processed(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """``logits`` (float32) after the logit processors of ``rows`` (bias, min-tokens,
        penalties): what greedy rows take the argmax of. A copy when anything is processed,
        else ``logits`` itself (float32)."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        if not any(penalties.needs_processing(r) for r in rows):
            return logits
        x = logits.clone(memory_format=torch.contiguous_format)
        penalties.apply_all(x, rows)
        return x

    def target_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each (non-greedy) row samples from: processors, temperature,
        top-k, top-p, min-p, softmax: exactly what ``__call__`` draws a token from."""
        x = self.processed(logits, rows)
        if x is logits or x.dtype != logits.dtype:
            x = x.clone(memory_format=torch.contiguous_format)
        return self._probs(x, list(rows))

    def with_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                      rows: Sequence[SamplingRow]) -> SamplerOutput:
        """A ``SamplerOutput`` of the given ``tokens`` (one per row) with the raw-distribution
        logprobs the rows asked for, as ``__call__`` reports them."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        return self._with_logprobs(logits, tokens, rows)

    def _probs(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k/top-p, min-p and softmax over processed logits ``x`` (changed in
        place) of non-greedy rows."""
        _temperature(x, rows)
        return _truncated_probs(x, rows)

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow],
                u: torch.Tensor | None = None) -> torch.Tensor:
        """Sample one token per row of ``x`` (processed logits of non-greedy rows, changed in
        place) with the uniforms ``u`` (drawn here when None): within the candidates when
        every row truncates its vocabulary (engine/sampling/truncated.py), else over the
        masked row."""
        if u is None:
            u = self._uniforms(rows, x.device, x.dtype)
            if truncates(rows, x.shape[1]):
                picked = sample_truncated(x, rows, u)
                if picked is not None:
                    return picked
        _temperature(x, rows)
        return inverse_cdf(_truncated_probs(x, rows).cumsum_(dim=-1), u)

    def _uniforms(self, rows: list[SamplingRow], dev: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
        """One uniform per row: a seeded row's from its own generator, the others' from the
        Sampler's (in one draw)."""
        u = torch.empty(len(rows), dtype=dtype, device=dev)
        shared = [k for k, r in enumerate(rows) if r.generator is None]
        if len(shared) == len(rows):
            u.uniform_(generator=self._generator(dev))
        else:
            if shared:
                s_idx = torch.tensor(shared, dtype=torch.long, device=dev)
                part = torch.empty(len(shared), dtype=dtype, device=dev)
                u.index_copy_(0, s_idx, part.uniform_(generator=self._generator(dev)))
            for k, r in enumerate(rows):
                if r.generator is not None:
                    g = r.generator
                    u[k] = torch.empty(1, dtype=dtype, device=g.device).uniform_(
                        generator=g).to(dev)[0]
        return u

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                       rows: Sequence[SamplingRow]) -> SamplerOutput:
        want = [r.params.logprobs for r in rows]
        if all(k is None for k in want):
            return SamplerOutput(tokens.tolist(), None, None, None)
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, tokens.unsqueeze(1))
        ranks = (lp > chosen).sum(dim=-1) + 1
        k_max = min(max(k or 0 for k in want), lp.shape[1])
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        if k_max > 0:
            vals, ids = lp.topk(k_max, dim=-1)
            vals_l, ids_l = vals.tolist(), ids.tolist()
            for i, k in enumerate(want):
                if k:
                    top[i] = list(zip(ids_l[i][:k], vals_l[i][:k], strict=True))
        return SamplerOutput(tokens.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top)


def _temperature(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=x.device)
    x.div_(temps.unsqueeze(1))


def _truncated_probs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Top-k/top-p, min-p (``x`` masked in place) and the softmax over the whole row."""
    _top_k_top_p(x, rows)
    _min_p(x, rows)
    return torch.softmax(x, dim=-1)


def _top_k_top_p(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask (to -inf, in place) tokens outside each row's top-k and then its top-p nucleus.

    top-k keeps every token whose logit ties the k-th. top-p keeps the smallest prefix of the
    tokens sorted by probability whose mass reaches ``top_p`` (the token that crosses it stays).
    """
    vocab = x.shape[1]
    sel = [k for k, r in enumerate(rows) if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
    if not sel:
        return
    dev = x.device
    idx = torch.tensor(sel, dtype=torch.long, device=dev)
    sub = x.index_select(0, idx)
    ks = torch.tensor([rows[k].params.top_k if 0 < rows[k].params.top_k < vocab else vocab
                       for k in sel], dtype=torch.long, device=dev)
    ps = [rows[k].params.top_p for k in sel]
    if all(p >= 1.0 for p in ps):
        # top-k only: a partial selection is much cheaper than sorting the vocabulary.
        kth = top_candidates(sub, int(ks.max()))[0].gather(1, (ks - 1).unsqueeze(1))
        sub.masked_fill_(sub < kth, float("-inf"))
    else:
        sub = _nucleus(sub, ks, torch.tensor(ps, dtype=x.dtype, device=dev))
    x.index_copy_(0, idx, sub)


# Sorting a whole vocabulary costs far more than an argmax on a CPU
# (docs/decisions.md#greedy-argmax). The nucleus of a language model
# almost always lies within its few hundred most likely tokens, so top-p first looks there
# (NUCLEUS_CANDIDATES) and sorts the whole row only when those candidates hold less than
# top_p of the mass.


def _nucleus(sub: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Logits ``sub`` with everything outside top-k (``ks``), then top-p (``ps``), at -inf."""
    vocab = sub.shape[1]
    ks_list = ks.tolist()
    n_cand = min(vocab, max([NUCLEUS_CANDIDATES] + [k for k in ks_list if k < vocab]))
    vals, order = top_candidates(sub, n_cand)  # sorted, most likely first
    # For a top-k row all its mass is among the candidates; otherwise the whole row's.
    short = mask_candidates(vals, ks, ps, vocab, torch.logsumexp(sub, dim=-1))
    out = torch.full_like(sub, float("-inf")).scatter_(1, order, vals)
    short = short.nonzero().flatten()
    if short.numel():
        # Candidates hold less than top_p of the mass: the nucleus needs the full sort.
        s = sub.index_select(0, short)
        srt, full_order = s.sort(dim=-1, descending=True)
        p = torch.softmax(srt, dim=-1)
        srt.masked_fill_(p.cumsum(dim=-1) - p >= ps[short].unsqueeze(1), float("-inf"))
        out.index_copy_(0, short, torch.empty_like(s).scatter_(1, full_order, srt))
    return out


def _min_p(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Mask tokens whose probability is below ``min_p`` times the row's largest probability."""
    sel = [k for k, r in enumerate(rows) if r.params.min_p > 0.0]
    if not sel:
        return
    dev = x.device
    idx = torch.tensor(sel, dtype=torch.long, device=dev)
    sub = x.index_select(0, idx)
    probs = torch.softmax(sub, dim=-1)
    mins = torch.tensor([rows[k].params.min_p for k in sel], dtype=x.dtype, device=dev)
    thresh = probs.max(dim=-1, keepdim=True).values * mins.unsqueeze(1)
    sub.masked_fill_(probs < thresh, float("-inf"))
    x.index_copy_(0, idx, sub)
