"""Sampler and logit processors against hand computations and empirical distributions."""

from __future__ import annotations

import math

import pytest
import torch

from engine.params.sampling import SamplingParams
from engine.sampling import penalties
from engine.sampling.prompt_logprobs import position_entries, reduce_logits
from engine.sampling.row import SamplingRow
from engine.sampling.sampler import Sampler, SamplerOutput

EOS = frozenset({0})


def row(params: SamplingParams | None = None, prompt=(), output=(), generator=None,
        eos=EOS, **kw) -> SamplingRow:
    params = params or SamplingParams(**kw)
    if params.seed is not None and generator is None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, list(prompt), list(output), generator, eos)


def logits(n: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


# ---- greedy --------------------------------------------------------------------------------


def test_temperature_zero_is_argmax():
    x = logits(16, 1000)
    out = Sampler()(x, [row(temperature=0.0) for _ in range(16)])
    assert out.token_ids == x.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.ranks is None and out.top_logprobs is None


def test_top_k_one_equals_greedy_even_with_ties_and_penalties():
    x = logits(8, 300).round()  # many exact ties, including at the maximum
    x[:, 7] = x.max(dim=-1).values  # a tie for first place in every row
    common = dict(repetition_penalty=1.3, presence_penalty=0.4, logit_bias={5: 1.5})
    greedy = [row(temperature=0.0, output=[i, 3], **common) for i in range(8)]
    top1 = [row(temperature=1.7, top_k=1, top_p=0.5, output=[i, 3], **common) for i in range(8)]
    sampler = Sampler(seed=3)
    for _ in range(3):
        assert sampler(x, top1).token_ids == sampler(x, greedy).token_ids


def test_input_logits_are_not_modified():
    x = logits(4, 100)
    before = x.clone()
    Sampler()(x, [row(temperature=0.8, top_p=0.7, repetition_penalty=2.0, output=[1, 2])
                  for _ in range(4)])
    assert torch.equal(x, before)


# ---- seeds ---------------------------------------------------------------------------------


def _run_seeded(seed: int, batch_before: int, batch_after: int, steps: int = 6,
                device: str = "cpu") -> list[int]:
    """Draw `steps` tokens for one seeded row placed among unseeded and other seeded rows."""
    sampler = Sampler(seed=batch_before * 7 + batch_after)  # the shared generator differs too
    x_all = logits(batch_before + 1 + batch_after, 500, seed=batch_after, scale=1.0)
    target = logits(1, 500, seed=11, scale=1.0)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=seed)
    g = torch.Generator().manual_seed(seed)
    got = []
    for step in range(steps):
        others = [row(temperature=1.0, seed=(100 + k if k % 2 else None))
                  for k in range(batch_before + batch_after)]
        rows = others[:batch_before] + [row(params, generator=g, output=got)] + \
            others[batch_before:]
        x = x_all.roll(step, dims=0).clone()
        x[batch_before] = target
        got.append(sampler(x.to(device), rows).token_ids[batch_before])
    return got


def test_seed_reproducible_in_any_batch():
    alone = _run_seeded(1234, 0, 0)
    assert _run_seeded(1234, 0, 0) == alone
    assert _run_seeded(1234, 3, 0) == alone
    assert _run_seeded(1234, 2, 5) == alone
    assert _run_seeded(1234, 0, 9) == alone
    # A different seed gives a different stream (fixed seeds: this is deterministic).
    assert _run_seeded(99, 1, 1) != alone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seed_reproducible_on_cuda_with_cpu_generators():
    alone = _run_seeded(1234, 0, 0, device="cuda")
    assert _run_seeded(1234, 3, 0, device="cuda") == alone
    assert _run_seeded(1234, 2, 5, device="cuda") == alone


def test_generator_advanced_only_by_its_own_draws():
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    greedy_seeded = row(SamplingParams(temperature=0.0, seed=5), generator=g)
    Sampler()(logits(3, 50), [greedy_seeded, row(temperature=1.0), row(temperature=1.0)])
    assert torch.equal(g.get_state(), state)
    sampled_seeded = row(SamplingParams(temperature=1.0, seed=5), generator=g)
    Sampler()(logits(1, 50), [sampled_seeded])
    assert not torch.equal(g.get_state(), state)


# ---- distributions -------------------------------------------------------------------------

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
N_DRAWS = 10000  # frequency std <= 0.005


def _frequencies(params_list: list[SamplingParams], probs=PROBS) -> list[torch.Tensor]:
    """Empirical token frequencies for each params, all drawn in ONE mixed batch."""
    n = len(params_list)
    x = probs.log().repeat(n * N_DRAWS, 1)
    rows = [row(p) for p in params_list for _ in range(N_DRAWS)]
    tokens = torch.tensor(Sampler(seed=42)(x, rows).token_ids).view(n, N_DRAWS)
    return [torch.bincount(t, minlength=len(probs)).float() / N_DRAWS for t in tokens]


def _expected(keep: list[int], weights=PROBS) -> torch.Tensor:
    w = torch.zeros_like(weights)
    w[keep] = weights[keep]
    return w / w.sum()


def test_sampling_distributions_in_a_mixed_batch():
    cases = [
        (SamplingParams(temperature=1.0), _expected([0, 1, 2, 3, 4])),
        # top_p: smallest set reaching p. 0.4 < 0.65 <= 0.7 -> {0, 1}; 0.7 < 0.75 -> {0, 1, 2}.
        (SamplingParams(temperature=1.0, top_p=0.65), _expected([0, 1])),
        (SamplingParams(temperature=1.0, top_p=0.75), _expected([0, 1, 2])),
        (SamplingParams(temperature=1.0, top_p=0.3), _expected([0])),
        (SamplingParams(temperature=1.0, top_k=2), _expected([0, 1])),
        # top_k 3 first (0.4, 0.3, 0.15 renormalised), then top_p 0.8 of that: 0.47+0.35 -> {0,1}
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.8), _expected([0, 1])),
        # min_p 0.3: threshold 0.12 -> {0, 1, 2}
        (SamplingParams(temperature=1.0, min_p=0.3), _expected([0, 1, 2])),
        # temperature 2: p ** (1/2) renormalised
        (SamplingParams(temperature=2.0), _expected([0, 1, 2, 3, 4], PROBS.sqrt())),
        # temperature 0.5 then top_p 0.9: p^2 = .16,.09,.0225,.01,.0025 -> .561,.316,.079,...
        (SamplingParams(temperature=0.5, top_p=0.9), _expected([0, 1, 2], PROBS ** 2)),
    ]
    freqs = _frequencies([p for p, _ in cases])
    for (params, want), got in zip(cases, freqs, strict=True):
        assert torch.equal(got > 0, want > 0), (params, got, want)  # masked tokens never drawn
        assert torch.allclose(got, want, atol=0.02), (params, got, want)


def test_top_p_needing_the_full_sort():
    # A flat distribution over 3000 tokens: the 512 best candidates hold only ~1/6 of the mass,
    # so the nucleus needs the full-row path; top_p 0.5 keeps exactly the 1500 best tokens.
    v = 3000
    x = torch.linspace(0.0, 0.01, v).repeat(1000, 1)  # nearly uniform, strictly increasing
    rows = [row(temperature=1.0, top_p=0.5) for _ in range(1000)]
    tokens = torch.tensor(Sampler(seed=1)(x, rows).token_ids)
    assert int(tokens.min()) >= 1499  # only the upper half of the vocabulary
    assert abs(tokens.float().mean().item() - 2250) < 60  # std of the mean ~14


def test_logit_bias_plus_100_forces_a_token():
    x = logits(64, 1000, scale=2.0)
    rows = [row(temperature=1.0, logit_bias={321: 100.0}) for _ in range(64)]
    assert Sampler(seed=0)(x, rows).token_ids == [321] * 64


def test_min_tokens_blocks_eos_and_stop_tokens():
    x = torch.zeros(6, 50)
    x[:, 0] = 50.0  # EOS overwhelmingly likely
    x[:, 9] = 45.0  # then a stop token
    params = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    rows = [row(params, output=[5] * n) for n in range(6)]
    got = Sampler(seed=0)(x, rows).token_ids
    assert all(t not in (0, 9) for t in got[:3])
    assert got[3:] == [0, 0, 0]
    greedy = [row(SamplingParams(temperature=0.0, min_tokens=2), output=[5] * n)
              for n in range(3)]
    assert Sampler()(x[:3], greedy).token_ids == [9, 9, 0]


# ---- penalties against hand computation ------------------------------------------------------


def _hand(x: list[float], prompt, output, rep=1.0, freq=0.0, pres=0.0, bias=None) -> list[float]:
    """The documented formulas, one token at a time."""
    x = list(x)
    for t, b in (bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        c = output.count(t)
        x[t] -= c * freq + (1.0 if c > 0 else 0.0) * pres
    return x


def test_penalties_match_hand_computation():
    x = logits(3, 12, seed=4)
    prompt, output = [1, 2, 2, 11], [2, 3, 3, 3, 7, 0]
    specs = [
        dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.7,
             logit_bias={4: 2.0, 3: -1.0}),
        dict(repetition_penalty=0.8),
        dict(frequency_penalty=-0.4, presence_penalty=1.1),
    ]
    rows = [row(prompt=prompt, output=output, temperature=0.0, **s) for s in specs]
    got = x.clone()
    penalties.apply_all(got, rows)
    for i, s in enumerate(specs):
        want = _hand(x[i].tolist(), prompt, output, rep=s.get("repetition_penalty", 1.0),
                     freq=s.get("frequency_penalty", 0.0),
                     pres=s.get("presence_penalty", 0.0), bias=s.get("logit_bias"))
        assert got[i].tolist() == pytest.approx(want, abs=1e-6)


def test_penalties_change_the_greedy_choice():
    # Token 3 leads by 1.0 but was generated twice: frequency 0.6 -> -1.2 makes token 5 win.
    x = torch.zeros(2, 8)
    x[:, 3], x[:, 5] = 3.0, 2.0
    plain = row(temperature=0.0, output=[3, 3])
    freq = row(temperature=0.0, output=[3, 3], frequency_penalty=0.6)
    assert Sampler()(x, [plain, freq]).token_ids == [3, 5]
    # Repetition 2.0 over the prompt: 3.0 / 2 = 1.5 < 2.0.
    rep = row(temperature=0.0, prompt=[3], repetition_penalty=2.0)
    assert Sampler()(x[:1], [rep]).token_ids == [5]


# ---- logprobs ------------------------------------------------------------------------------


def _rank(lp: torch.Tensor, tok: int) -> int:
    return 1 + int((lp > lp[tok]).sum())


def test_logprobs_are_raw_and_ranks_right():
    x = logits(5, 200, seed=8)
    x[2, :] = x[2].round()  # ties
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=1.0, logprobs=0, repetition_penalty=1.5, output=[1, 2]),
        row(temperature=0.7, top_p=0.5, logprobs=5, logit_bias={10: 30.0}),
        row(temperature=0.0),  # did not ask
        row(temperature=1.0, top_k=4, logprobs=1),
    ]
    out = Sampler(seed=2)(x, rows)
    raw = torch.log_softmax(x, dim=-1)
    assert out.token_ids[2] == 10  # the bias is applied to sampling...
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-6)  # ...not to these
        assert out.ranks[i] == _rank(raw[i], tok)
    for i, r in enumerate(rows):
        k = r.params.logprobs or 0
        vals, ids = raw[i].sort(descending=True)
        assert [t for t, _ in out.top_logprobs[i]] == ids[:k].tolist() or i == 2
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(vals[:k].tolist(), abs=1e-6)
    assert out.top_logprobs[3] == []
    entry = out.position_logprobs(0, token_text=lambda t: f"<{t}>")
    assert list(entry)[0] == out.token_ids[0]
    assert all(lp.decoded_token == f"<{t}>" for t, lp in entry.items())
    assert all(lp.rank == _rank(raw[0], t) for t, lp in entry.items())


def prompt_logprobs(x, targets, k, token_text=None):
    """A whole prompt's entries in one piece, through the engine's reduction."""
    reduced = reduce_logits(x, torch.tensor(targets, dtype=torch.long), k)
    return position_entries(reduced, 0, len(targets), targets, k, token_text)


def test_prompt_logprobs():
    x = logits(6, 90, seed=3)
    x[4] = x[4].round()
    targets = [5, 17, 0, 89, 44, 44]
    got = prompt_logprobs(x, targets, k=4, token_text=str)
    raw = torch.log_softmax(x, dim=-1)
    assert len(got) == 6
    for j, entry in enumerate(got):
        tok = targets[j]
        assert entry[tok].logprob == pytest.approx(raw[j, tok].item(), abs=1e-6)
        assert entry[tok].rank == _rank(raw[j], tok)
        assert entry[tok].decoded_token == str(tok)
        top = raw[j].topk(4).indices.tolist()
        assert set(top) <= set(entry)
        for t in entry:
            assert entry[t].rank == _rank(raw[j], t)
            assert entry[t].logprob == pytest.approx(raw[j, t].item(), abs=1e-6)
        assert len(entry) == 4 + (tok not in top)
    assert prompt_logprobs(x, targets, k=0)[1].keys() == {17}
    assert prompt_logprobs(x[:0], [], k=2) == []


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 10), [row()])


def test_out_of_range_ids_are_ignored_not_fatal():
    x = logits(1, 20)
    r = row(temperature=0.0, logit_bias={5000: 100.0}, stop_token_ids=[999], min_tokens=2,
            repetition_penalty=1.5, prompt=[4000], output=[3000])
    assert Sampler()(x, [r]).token_ids == x.argmax(dim=-1).tolist()


def test_sampler_output_without_logprobs():
    out = SamplerOutput([1], None, None, None)
    assert out.position_logprobs(0) is None
    assert not math.isnan(Sampler()(logits(1, 5), [row(logprobs=2)]).logprobs[0])


def _reference_keep(x: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Straightforward top-k then top-p over one row of logits."""
    order = x.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(x[order].double(), dim=0).tolist()
    keep, mass = set(), 0.0
    for tok, p in zip(order, probs, strict=True):
        if mass >= top_p:
            break
        keep.add(tok)
        mass += p
    return keep


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaked (candidates suffice) and flat (full sort)
def test_top_k_top_p_mask_matches_reference(scale):
    from engine.sampling.sampler import _top_k_top_p

    v = 2000
    specs = [(-1, 0.9), (50, 0.9), (1000, 0.95), (600, 1.0), (-1, 0.2), (3, 0.999)]
    x = logits(len(specs), v, seed=21, scale=scale)
    rows = [row(temperature=1.0, top_k=k, top_p=p) for k, p in specs]
    masked = x.clone()
    _top_k_top_p(masked, rows)
    for i, (k, p) in enumerate(specs):
        got = set(torch.isfinite(masked[i]).nonzero().flatten().tolist())
        assert got == _reference_keep(x[i], k, p), (k, p)
        kept = masked[i][torch.isfinite(masked[i])]
        assert torch.equal(kept, x[i][torch.isfinite(masked[i])])  # kept logits unchanged


def test_logit_bias_tensors_are_built_once_per_request(monkeypatch):
    """The bias of a request is turned into tensors at its first step and reused after."""
    from engine.sampling import penalties

    cache: dict = {}
    r = SamplingRow(SamplingParams(temperature=0.0, logit_bias={3: 50.0, 7: -5.0, 900: 1.0}),
                    [], [], None, EOS, cache=cache)
    built = {"n": 0}
    real = penalties._bias_tensors

    def counting(*args, **kwargs):
        result = real(*args, **kwargs)
        built["n"] += 1
        return result

    x = logits(1, 20, seed=4)
    want = x.clone()
    want[0, 3] += 50.0
    want[0, 7] -= 5.0
    for _ in range(3):
        y = x.clone()
        penalties.apply_logit_bias(y, [r])
        assert torch.equal(y, want)  # 900 is outside this vocabulary: ignored
    first = cache["logit_bias"]
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: pytest.fail("rebuilt the bias"))
    penalties.apply_logit_bias(x.clone(), [r])
    assert cache["logit_bias"] is first


def test_first_argmax_equals_argmax_on_ties():
    """The greedy path's ``max(dim=-1).indices`` picks the first maximal index, as argmax."""
    from engine.sampling.sampler import first_argmax

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randint(0, 4, (5, 300), generator=g).float()  # many ties per row
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
