"""Top-k / top-p sampling within the candidates (engine/sampling/truncated.py) against the
sampler's general path (the masked full row): the same tokens from the same uniforms, the
same distributions, the fallback when a nucleus lies beyond the candidates, and
engine/sampling/candidates.py's selection against torch.topk."""

from __future__ import annotations

import pytest
import torch

import engine.sampling.sampler as sampler_module
from engine.params.sampling import SamplingParams
from engine.sampling.candidates import CHUNK, top_candidates
from engine.sampling.row import SamplingRow
from engine.sampling.sampler import Sampler
from engine.sampling.truncated import sample_truncated, truncates


def _rows(n: int, seed0: int | None = None, **params) -> list[SamplingRow]:
    out = []
    for i in range(n):
        p = SamplingParams(seed=None if seed0 is None else seed0 + i, **params)
        g = None if p.seed is None else torch.Generator().manual_seed(p.seed)
        out.append(SamplingRow(p, [1], [], g, frozenset()))
    return out


def _zipf_logits(rows: int, vocab: int, seed: int = 0, s: float = 1.2) -> torch.Tensor:
    """Language-model-like rows: probabilities ~ rank^-s at shuffled positions."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    return torch.stack([(-s * ranks.log())[torch.randperm(vocab, generator=g)]
                        for _ in range(rows)])


@pytest.mark.parametrize("shape", [(3, 64 * CHUNK * 8 * 8), (5, 49_152), (2, 1000)])
@pytest.mark.parametrize("n", [1, 50, 512])
def test_candidates_are_topk(shape, n):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(n)) * 3
    values, index = top_candidates(x, n)
    want = x.topk(n, dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(x.gather(1, index), values)  # indices of those values (ties aside)
    assert all(len(set(r)) == n for r in index.tolist())


def _general(monkeypatch):
    monkeypatch.setattr(sampler_module, "truncates", lambda *_: False)


@pytest.mark.parametrize("params", [
    {"temperature": 1.0, "top_k": 64, "top_p": 0.95},  # Gemma's generation defaults
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 40},
    {"temperature": 0.8, "top_p": 0.95, "min_p": 0.05},
])
def test_same_tokens_as_the_general_path(params, monkeypatch):
    x = _zipf_logits(16, 65_536)
    assert truncates(_rows(1, **params), x.shape[1])
    fast = [Sampler(seed=3)(x, _rows(16, seed0=100 + d, **params)).token_ids for d in range(30)]
    _general(monkeypatch)
    slow = [Sampler(seed=3)(x, _rows(16, seed0=100 + d, **params)).token_ids for d in range(30)]
    same = sum(a == b for fa, sa in zip(fast, slow) for a, b in zip(fa, sa))
    assert same >= 16 * 30 - 1, same  # equal but for a uniform within rounding of a boundary


def test_distribution_within_the_candidates():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    x = torch.full((4000, 4096), -30.0)
    x[:, [7, 900, 2048, 3000, 4095]] = probs.log()
    tokens = torch.tensor(Sampler(seed=5)(x, _rows(4000, top_k=3, top_p=0.8)).token_ids)
    # top-k 3 (0.4, 0.3, 0.15 renormalised) then top-p 0.8: {7, 900} in 0.4 : 0.3
    assert set(tokens.tolist()) == {7, 900}
    assert abs((tokens == 7).float().mean().item() - 0.4 / 0.7) < 0.03


def test_nucleus_beyond_the_candidates_falls_back():
    x = torch.linspace(0.0, 0.01, 3000).repeat(4, 1)  # flat: 512 candidates hold ~1/6
    rows = _rows(4, temperature=1.0, top_p=0.5)
    assert sample_truncated(x, rows, torch.full((4,), 0.5)) is None
    tokens = Sampler(seed=1)(x, rows).token_ids  # the general path's full sort
    assert min(tokens) >= 1499


def test_logits_unchanged_and_seeded_rows_batch_invariant():
    x = _zipf_logits(6, 32_768, seed=2)
    before = x.clone()
    params = {"temperature": 0.9, "top_k": 20, "top_p": 0.9}
    batch = Sampler()(x, _rows(6, seed0=7, **params)).token_ids
    assert torch.equal(x, before)
    alone = [Sampler()(x[i:i + 1], _rows(1, seed0=7 + i, **params)).token_ids[0]
             for i in range(6)]
    assert batch == alone


def test_nucleus_beyond_the_first_look_takes_the_second(monkeypatch):
    """200 tokens of equal weight hold ~95% of the mass: top-p 0.9 needs ~190 of them, more
    than NUCLEUS_FIRST and fewer than NUCLEUS_CANDIDATES."""
    from engine.sampling.truncated import NUCLEUS_CANDIDATES, NUCLEUS_FIRST

    vocab = 65_536
    x = torch.full((8, vocab), -10.0)
    g = torch.Generator().manual_seed(4)
    for r in range(8):
        x[r, torch.randperm(vocab, generator=g)[:200]] = 0.0
    rows = _rows(8, seed0=50, temperature=1.0, top_p=0.9)
    assert NUCLEUS_FIRST < 190 < NUCLEUS_CANDIDATES
    assert sample_truncated(x, rows, torch.full((8,), 0.3)) is not None
    fast = [Sampler()(x, _rows(8, seed0=50 + d, temperature=1.0, top_p=0.9)).token_ids
            for d in range(20)]
    assert all(x[i, t] == 0.0 for draw in fast for i, t in enumerate(draw))
    _general(monkeypatch)
    slow = [Sampler()(x, _rows(8, seed0=50 + d, temperature=1.0, top_p=0.9)).token_ids
            for d in range(20)]
    assert sum(a == b for f, s in zip(fast, slow) for a, b in zip(f, s)) >= 159
