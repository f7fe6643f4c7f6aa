"""Speculative decoding (n-gram) end to end on a tiny random Llama: greedy output is token for
token the output of one-token decoding, drafts are really accepted, and the KV pool ends clean,
across prefix-cache hits (including prompts that reuse blocks written by speculating steps),
recompute and swap preemption, stop strings, stop tokens, max_tokens, n > 1, penalties and
logprobs; seeded sampling stays reproducible; the adaptive switch turns drafts off.

The model is initialised with a small weight scale (0.05): its greedy continuations fall into
short loops, which is what makes n-gram drafts get accepted."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir

BS = 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BS  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("spec"), "llama", seed=2,
                               initializer_range=0.05)


def _llm(model_dir, spec: bool, blocks: int = 2048, **overrides) -> LLM:
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory=blocks * BLOCK_BYTES)
    if spec:
        cfg["speculative_config"] = overrides.pop("speculative_config", NGRAM)
    cfg.update(overrides)
    return LLM(str(model_dir), **cfg)


@pytest.fixture(scope="module")
def base(model_dir):
    return _llm(model_dir, spec=False)


@pytest.fixture(scope="module")
def spec(model_dir):
    return _llm(model_dir, spec=True)


def _prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        unit = [rng.randrange(0, 256) for _ in range(rng.randint(2, 6))]
        out.append((unit * 8)[:rng.randint(5, 30)] + [rng.randrange(0, 256)
                                                      for _ in range(rng.randint(0, 5))])
    return out


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, "ignore_eos": True, **kw})


def _outs(llm: LLM, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params)]


def _accepted(llm: LLM, before: dict | None = None) -> int:
    now = llm.stats()["spec_decode_num_accepted_tokens"]
    return now - (before or {}).get("spec_decode_num_accepted_tokens", 0)


def _assert_clean(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    s = llm.stats()
    assert s["num_blocks_used"] == 0
    assert s.get("host_blocks_used", 0) == 0


def _in_vocab(tokens: list[int]) -> list[int]:
    """The tokens before the first id the tokenizer lacks (the model has 2 spare ids)."""
    bad = [i for i, t in enumerate(tokens) if t >= 258]
    return tokens[:bad[0]] if bad else tokens


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x, y, strict=True):
            assert cx.token_ids == cy.token_ids
            assert cx.text == cy.text
            assert (cx.finish_reason, cx.stop_reason) == (cy.finish_reason, cy.stop_reason)


def test_greedy_is_identical_and_drafts_are_accepted(base, spec):
    prompts = _prompts()
    params = [_greedy(max_tokens=n) for n in (40, 7, 33, 1, 25, 40, 2, 19)]
    before = spec.stats()
    _same(_outs(base, prompts, params), _outs(spec, prompts, params))
    s = spec.stats()
    drafts = s["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    assert drafts > 0 and _accepted(spec, before) > drafts  # more than one token per draft
    assert s["spec_decode_num_accepted_tokens_pos3"] > 0  # whole drafts were accepted
    assert s["num_steps"] - before["num_steps"] < 40  # fewer steps than tokens
    _assert_clean(spec)


def test_prefix_hits_on_blocks_written_while_speculating(base, spec):
    """Continuations of earlier outputs hit blocks whose KV was written by verification
    steps: were a rejected draft's K/V ever cached, these outputs would differ."""
    prompts = _prompts(6, seed=11)
    first = _outs(spec, prompts, _greedy(max_tokens=30))
    _same(_outs(base, prompts, _greedy(max_tokens=30)), first)
    longer = [p + _in_vocab(o[0].token_ids) for p, o in zip(prompts, first)]
    before = spec.stats()
    got = spec.generate(longer, _greedy(max_tokens=20))
    # Hits reach past the prompts into blocks of generated (speculated) tokens.
    assert any(o.num_cached_tokens >= len(p) + BS for o, p in zip(got, prompts))
    assert spec.stats()["prefix_cache_hits"] > before["prefix_cache_hits"]
    _same(_outs(base, longer, _greedy(max_tokens=20)), [o.outputs for o in got])
    _assert_clean(spec)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_is_identical_under_preemption(model_dir, base, mode):
    prompts = _prompts(8, seed=5)
    params = _greedy(max_tokens=36)
    swap = 64 * BLOCK_BYTES / 2**30 if mode == "swap" else 0.0
    tight = _llm(model_dir, spec=True, blocks=40, preemption_mode=mode, swap_space=swap)
    _same(_outs(base, prompts, params), _outs(tight, prompts, params))
    s = tight.stats()
    assert s[f"num_preemptions_{mode}"] > 0
    assert s["spec_decode_num_accepted_tokens"] > 0
    _assert_clean(tight)


def test_stops_inside_accepted_runs_end_where_plain_decoding_does(base, spec):
    prompts = _prompts(4, seed=7)
    free = _outs(base, prompts, _greedy(max_tokens=40))
    for p, o in zip(prompts, free):
        toks, text = o[0].token_ids, o[0].text
        cases = [_greedy(max_tokens=n) for n in (3, 9, 14)]
        cases += [_greedy(stop_token_ids=[toks[i]]) for i in (4, 10, 20)]
        cases += [_greedy(stop=[text[i:i + 2]]) for i in (6, 15) if len(text) > i + 2]
        cases += [_greedy(stop=[text[12:14]], include_stop_str_in_output=True)]
        want = _outs(base, [p] * len(cases), cases)
        got = _outs(spec, [p] * len(cases), cases)
        _same(want, got)
    assert _accepted(spec) > 0
    _assert_clean(spec)


def test_eos_min_tokens_penalties_logprobs_and_n(base, spec):
    prompts = _prompts(4, seed=9)
    cases = [
        SamplingParams(temperature=0, max_tokens=30, min_tokens=5),  # EOS counts
        _greedy(repetition_penalty=1.2),
        _greedy(frequency_penalty=0.3, presence_penalty=0.2),
        _greedy(logit_bias={65: 3.0, 66: -2.0}),
        _greedy(n=3, max_tokens=25),
        _greedy(logprobs=2),
    ]
    for params in cases:
        want = _outs(base, prompts, params)
        got = _outs(spec, prompts, params)
        _same(want, got)
        if params.logprobs:
            for x, y in zip(want, got):
                for a, b in zip(x[0].logprobs, y[0].logprobs, strict=True):
                    assert set(a) == set(b)
                    for tok in a:
                        assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)
                        assert a[tok].rank == b[tok].rank
    _assert_clean(spec)


def test_seeded_sampling_with_speculation_is_reproducible(spec):
    prompts = _prompts(3, seed=13)
    params = SamplingParams(temperature=0.5, top_k=20, seed=7, max_tokens=30, ignore_eos=True)
    before = spec.stats()
    a = _outs(spec, prompts, params)
    b = _outs(spec, prompts + [[1, 2, 3]], [params] * 3 + [_greedy()])[:3]
    assert [o[0].token_ids for o in a] == [o[0].token_ids for o in b]
    assert _accepted(spec, before) > 0
    _assert_clean(spec)


def test_adaptive_switch_turns_drafts_off_for_large_batches(model_dir):
    cfg = dict(NGRAM, disable_by_batch_size=2)
    llm = _llm(model_dir, spec=True, speculative_config=cfg)
    llm.generate(_prompts(4), _greedy(max_tokens=20))  # 4 decoding at once: off
    assert llm.stats()["spec_decode_num_drafts"] == 0
    llm.generate(_prompts(2), _greedy(max_tokens=20))
    assert llm.stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3"])
def test_greedy_is_identical_over_a_quantised_kv_cache(model_dir, kv_dtype):
    """Verification rows read the 8-bit or 4-bit pool through the same decode kernel as
    one-token steps, and rejected drafts' rows (and their scales) are rewritten before they
    are read."""
    prompts = _prompts(4, seed=17)
    params = _greedy(max_tokens=30)
    plain = _llm(model_dir, spec=False, kv_cache_dtype=kv_dtype)
    spec = _llm(model_dir, spec=True, kv_cache_dtype=kv_dtype)
    _same(_outs(plain, prompts, params), _outs(spec, prompts, params))
    assert _accepted(spec) > 0
    _assert_clean(spec)


# ---- draft_model ---------------------------------------------------------------------------


def _draft_cfg(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "disable_by_batch_size": None}


@pytest.mark.parametrize("budget", [2048, 8])
def test_draft_model_that_is_the_target_has_every_draft_accepted(model_dir, base, budget):
    """With a step budget of 8 tokens the draft's catch-up of a prompt takes several steps
    (no draft meanwhile), as the target's chunked prefill does."""
    prompts = _prompts(5, seed=19)
    params = [_greedy(max_tokens=n) for n in (30, 11, 2, 25, 30)]
    llm = _llm(model_dir, spec=True, speculative_config=_draft_cfg(model_dir),
               max_num_batched_tokens=budget)
    _same(_outs(base, prompts, params), _outs(llm, prompts, params))
    s = llm.stats()
    assert s["spec_decode_num_drafts"] > 0
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    _assert_clean(llm)
    assert llm.engine.scheduler.proposer.kv.num_free_blocks == \
        llm.engine.scheduler.proposer.kv.num_blocks  # draft state released


@pytest.mark.parametrize("mode", ["none", "recompute", "swap"])
def test_draft_model_of_other_weights_keeps_greedy_exact(model_dir, base, tmp_path_factory,
                                                         mode):
    """A draft that often disagrees (another random model of the same vocabulary): its KV is
    rolled back as the target's is, across preemption, and the output stays the target's."""
    draft = make_tiny_model_dir(tmp_path_factory.mktemp("draft"), "llama", seed=4,
                                initializer_range=0.05, num_hidden_layers=1)
    prompts = _prompts(6, seed=23)
    params = _greedy(max_tokens=32)
    extra = {} if mode == "none" else dict(
        blocks=40, preemption_mode=mode,
        swap_space=64 * BLOCK_BYTES / 2**30 if mode == "swap" else 0.0)
    llm = _llm(model_dir, spec=True, speculative_config=_draft_cfg(draft, k=4), **extra)
    _same(_outs(base, prompts, params), _outs(llm, prompts, params))
    s = llm.stats()
    assert s["spec_decode_num_drafts"] > 0
    if mode != "none":
        assert s[f"num_preemptions_{mode}"] > 0
    _assert_clean(llm)


def test_draft_model_sampling_is_seeded_and_reproducible(model_dir):
    llm = _llm(model_dir, spec=True, speculative_config=_draft_cfg(model_dir))
    params = SamplingParams(temperature=0.5, top_k=2, seed=5, max_tokens=24, ignore_eos=True)
    a = _outs(llm, _prompts(3, seed=29), params)
    b = _outs(llm, _prompts(3, seed=29), params)
    assert [o[0].token_ids for o in a] == [o[0].token_ids for o in b]
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    _assert_clean(llm)


def test_draft_model_of_another_vocabulary_is_refused(model_dir, tmp_path_factory):
    other = make_tiny_model_dir(tmp_path_factory.mktemp("vocab"), "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 260"):
        _llm(model_dir, spec=True, speculative_config=_draft_cfg(other))


def test_greedy_is_identical_with_a_sliding_window_releasing_blocks(tmp_path_factory):
    """Mistral with a 6-token window: blocks behind it go back to the pool as sequences grow
    (also right after a verification's rollback), verification rows attend through the window,
    and the output stays that of one-token decoding."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("mistral"), "mistral", seed=2,
                               initializer_range=0.05, sliding_window=6)
    prompts = _prompts(4, seed=31)
    params = _greedy(max_tokens=40)
    plain = _llm(path, spec=False)
    spec = _llm(path, spec=True)
    _same(_outs(plain, prompts, params), _outs(spec, prompts, params))
    s = spec.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0 and s["num_blocks_released_window"] > 0
    _assert_clean(spec)
