"""Greedy outputs of the whole engine equal HF transformers' ``generate`` on the same weights.

Tiny random Llama, Mistral (sliding window smaller than the prompts), Qwen2 and Qwen3 models;
single requests and a dozen concurrent requests of different lengths, and the same under prefix
caching on/off, preemption by a tiny pool, chunked prefill by a tiny token budget, n > 1.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir

MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3"]


def _workload(seed: int, n: int = 12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    lengths = [rng.randint(1, 20) for _ in range(n)]
    return prompts, lengths


@pytest.fixture(scope="module", params=MODEL_TYPES)
def tiny(request, tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                               **({"sliding_window": 6} if request.param == "mistral" else {}))
    hf = load_hf(path)
    prompts, lengths = _workload(MODEL_TYPES.index(request.param))
    expected = [hf_greedy(hf, p, k) for p, k in zip(prompts, lengths)]
    return path, prompts, lengths, expected


def _run(llm: LLM, prompts, lengths):
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    return llm.generate(prompts, params)


def _engine(path, **overrides) -> LLM:
    cfg = dict(dtype="float32", block_size=4, kv_cache_memory="8MiB")
    cfg.update(overrides)
    return LLM(str(path), **cfg)


def test_single_requests_match_hf(tiny):
    path, prompts, lengths, expected = tiny
    llm = _engine(path, max_num_seqs=1)
    for p, k, exp in list(zip(prompts, lengths, expected))[:4]:
        assert _run(llm, [p], [k])[0].outputs[0].token_ids == exp


def test_concurrent_requests_match_hf(tiny):
    path, prompts, lengths, expected = tiny
    llm = _engine(path)
    outs = _run(llm, prompts, lengths)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    llm.engine.kv.check_integrity()
    assert llm.stats()["num_blocks_used"] == 0


@pytest.mark.parametrize("overrides", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 7},  # chunked prefill: prompts up to 40 tokens in 7-token chunks
    {"max_num_seqs": 3},
], ids=["no-prefix-cache", "chunked-prefill", "few-seqs"])
def test_engine_settings_keep_outputs(tiny, overrides):
    path, prompts, lengths, expected = tiny
    llm = _engine(path, **overrides)
    assert [o.outputs[0].token_ids for o in _run(llm, prompts, lengths)] == expected


def test_preemption_keeps_outputs(tiny):
    path, prompts, lengths, expected = tiny
    # 16 blocks of 4 tokens: far less than 12 concurrent sequences need.
    a = load_hf(path).config
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    per_token = 2 * a.num_hidden_layers * a.num_key_value_heads * head_dim * 4
    llm = _engine(path, kv_cache_memory=per_token * 4 * 16)
    outs = _run(llm, prompts, lengths)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if llm.engine.sliding_window is None:
        assert llm.stats()["num_preemptions"] > 0
    else:  # Mistral (window 6) gives blocks back as it grows: 16 blocks are enough for it
        assert llm.stats()["num_blocks_released_window"] > 0
    llm.engine.kv.check_integrity()


def test_shared_system_prompt_hits_prefix_cache(tiny):
    path, _, _, _ = tiny
    hf = load_hf(path)
    system = list(range(100, 140))  # 40 tokens = 10 full blocks of 4
    prompts = [system + [7, i, 9] for i in range(5)]
    expected = [hf_greedy(hf, p, 5) for p in prompts]
    llm = _engine(path)
    first = _run(llm, prompts[:1], [5])[0]
    assert first.num_cached_tokens == 0
    rest = _run(llm, prompts[1:], [5] * 4)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == expected
    assert all(o.num_cached_tokens == 40 for o in rest)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 4 * 40


def test_n_samples_share_prompt_blocks(tiny):
    path, prompts, lengths, expected = tiny
    llm = _engine(path, enable_prefix_caching=False)
    out = llm.generate([prompts[0]], SamplingParams(n=3, temperature=0, max_tokens=lengths[0],
                                                    ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected[0] for c in out.outputs)
    assert llm.stats()["num_blocks_used"] == 0
