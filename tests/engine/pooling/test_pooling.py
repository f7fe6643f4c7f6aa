"""Pooling requests (engine.pooling) against HF transformers on the same weights.

A tiny random Qwen3 built from a config: the engine's pooled vectors equal ``AutoModel``'s
final hidden states put through the pooling rule (last token, mean, CLS; normalised or not;
Matryoshka dimensions) to 1e-4 in float32, alone, beside generation, chunked by a small token
budget, and after a prefix-cache hit; the yes/no head scores equal the last token's logits of
``AutoModelForCausalLM``.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from engine.params.pooling import PoolingParams


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3)


@pytest.fixture(scope="module")
def hf_body(tiny_qwen3):
    return AutoModel.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def _prompts(seed: int, n: int, lo: int = 1, hi: int = 60, prefix: list[int] = ()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def reference(model, ids: list[int], p: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[p.method]
    if p.dimensions is not None:
        v = v[:p.dimensions]
    return torch.nn.functional.normalize(v, dim=0) if p.normalize else v


def _engine(path, **overrides) -> LLM:
    cfg = dict(dtype="float32", block_size=4, kv_cache_memory="8MiB")
    cfg.update(overrides)
    return LLM(str(path), **cfg)


def _pool(llm: LLM, prompts, p: PoolingParams):
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, pooling=p))
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "stop"
        assert o.outputs[0].token_ids == []
    return outs


CASES = [PoolingParams("last"), PoolingParams("mean"), PoolingParams("cls"),
         PoolingParams("last", normalize=False), PoolingParams("mean", normalize=False),
         PoolingParams("last", dimensions=16), PoolingParams("mean", dimensions=7)]


@pytest.mark.parametrize("chunked", [False, True])
def test_pooled_vectors_match_hf(tiny_qwen3, hf_body, chunked):
    llm = _engine(tiny_qwen3, **({"max_num_batched_tokens": 16} if chunked else {}))
    prompts = _prompts(1, 6)
    for p in CASES:
        outs = _pool(llm, prompts, p)
        for ids, o in zip(prompts, outs, strict=True):
            want = reference(hf_body, ids, p)
            got = torch.tensor(o.pooled)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_pooling_beside_generation(tiny_qwen3, hf_body):
    """Pooling and generation requests in the same steps: vectors exact, tokens as alone."""
    llm = _engine(tiny_qwen3)
    prompts = _prompts(2, 8)
    gen = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], gen)]
    p = PoolingParams("mean")
    outs = llm.generate(prompts, [gen] * 4 + [SamplingParams(max_tokens=1, pooling=p)] * 4)
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone
    for ids, o in zip(prompts[4:], outs[4:], strict=True):
        torch.testing.assert_close(torch.tensor(o.pooled), reference(hf_body, ids, p),
                                   atol=1e-4, rtol=1e-4)


def test_prefix_shared_batch_equals_one_by_one(tiny_qwen3, hf_body):
    """Last-token pooling shares the prefix cache: inputs with a common 64-token instruction
    give the same vectors as one by one in a fresh engine, with cached tokens > 0."""
    instruction = _prompts(9, 1, 64, 64)[0]
    prompts = _prompts(4, 6, 5, 40, prefix=instruction)
    p = PoolingParams("last")
    fresh = _engine(tiny_qwen3, enable_prefix_caching=False)
    alone = [_pool(fresh, [x], p)[0].pooled for x in prompts]
    llm = _engine(tiny_qwen3)
    _pool(llm, prompts[:1], p)  # the instruction's blocks are now cached
    outs = _pool(llm, prompts[1:], p)
    assert all(o.num_cached_tokens >= 64 for o in outs)
    for a, o, ids in zip(alone[1:], outs, prompts[1:], strict=True):
        torch.testing.assert_close(torch.tensor(o.pooled), torch.tensor(a), atol=1e-5,
                                   rtol=1e-5)
        torch.testing.assert_close(torch.tensor(o.pooled), reference(hf_body, ids, p),
                                   atol=1e-4, rtol=1e-4)
    # a prompt seen before (every full block cached) still computes and pools its last token
    again = _pool(llm, prompts[:1], p)[0]
    assert again.num_cached_tokens > 0
    torch.testing.assert_close(torch.tensor(again.pooled), torch.tensor(alone[0]),
                               atol=1e-5, rtol=1e-5)


def test_mean_pooling_does_not_use_a_prefix_hit(tiny_qwen3, hf_body):
    prefix = _prompts(5, 1, 32, 32)[0]
    prompts = _prompts(6, 3, 4, 10, prefix=prefix)
    llm = _engine(tiny_qwen3)
    _pool(llm, prompts, PoolingParams("last"))
    outs = _pool(llm, prompts, PoolingParams("mean"))
    for ids, o in zip(prompts, outs, strict=True):
        assert o.num_cached_tokens == 0
        torch.testing.assert_close(torch.tensor(o.pooled),
                                   reference(hf_body, ids, PoolingParams("mean")),
                                   atol=1e-4, rtol=1e-4)


def test_head_scores_match_causal_lm(tiny_qwen3):
    """A yes/no reranker's scores: the last token's logits at two ids equal HF's."""
    lm = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    heads = (ord("n"), ord("y"))
    prompts = _prompts(7, 5, 10, 50)
    llm = _engine(tiny_qwen3, max_num_batched_tokens=24)
    outs = _pool(llm, prompts, PoolingParams("last", head_token_ids=heads))
    for ids, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(torch.tensor(o.pooled), logits[list(heads)], atol=1e-4,
                                   rtol=1e-4)


def test_preempted_pooling_request_is_exact(tiny_qwen3, hf_body):
    """A pool too small for a growing generation and a pooling prefill at once: the pooling
    request is preempted mid-prefill (recompute) and its rows are not summed twice."""
    llm = _engine(tiny_qwen3, kv_cache_memory="48KiB", max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    gen = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    prompts = [_prompts(10, 1, 8, 8)[0]] + _prompts(8, 3, 30, 40)
    p = PoolingParams("mean")
    outs = llm.generate(prompts, [gen] + [SamplingParams(max_tokens=1, pooling=p)] * 3)
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, o in zip(prompts[1:], outs[1:], strict=True):
        torch.testing.assert_close(torch.tensor(o.pooled), reference(hf_body, ids, p),
                                   atol=1e-4, rtol=1e-4)


def test_bad_pooling_params():
    with pytest.raises(ValueError, match="pooling method"):
        PoolingParams("max")
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, pooling=PoolingParams())
