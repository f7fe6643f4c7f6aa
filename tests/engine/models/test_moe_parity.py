"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against HF transformers on the same weights:
greedy outputs identical at float32 (single and concurrent requests, preemption), the
router's expert choice equal to HF's, and the grouped (routed-only) and dense (all experts)
paths equal to each other."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir
from engine.models.moe import MoeExperts, route

MOE_TYPES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=MOE_TYPES)
def tiny_moe(request, tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    hf = load_hf(path)
    rng = random.Random(MOE_TYPES.index(request.param))
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(8, 24))] for _ in range(6)]
    lengths = [rng.randint(4, 10) for _ in range(6)]
    expected = [hf_greedy(hf, p, k) for p, k in zip(prompts, lengths)]
    return path, hf, prompts, lengths, expected


def _engine(path, **overrides) -> LLM:
    cfg = dict(dtype="float32", block_size=4)
    cfg.update(overrides)
    return LLM(str(path), **cfg)


def _run(llm: LLM, prompts, lengths):
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_and_routing_match_hf(tiny_moe):
    """Concurrent requests through a pool too small for them (preemption), then one prompt
    whose per-layer expert choice is compared with HF's router."""
    path, hf, prompts, lengths, expected = tiny_moe
    c = hf.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (
        getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * 4
    llm = _engine(path, kv_cache_memory=per_token * 4 * 9)  # 9 blocks of 4 tokens
    assert _run(llm, prompts, lengths) == expected
    assert llm.stats()["num_preemptions"] > 0
    llm.engine.kv.check_integrity()

    ids = prompts[0] + prompts[1]
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, inp, out, i=i: seen.__setitem__(i, out[2].clone()))
        for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    with torch.no_grad():
        hf(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    blocks = llm.engine.runner.model.moe_blocks()
    assert sorted(blocks) == sorted(seen) and blocks
    for block in blocks.values():
        block.record = True
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    for i, block in blocks.items():
        assert torch.equal(block.last_ids, seen[i]), f"layer {i} routes differently"


@pytest.mark.parametrize("normalise", [True, False])
def test_grouped_and_dense_paths_agree(normalise):
    torch.manual_seed(0)
    experts = MoeExperts(num_experts=6, hidden=32, intermediate=24)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(37, 32)
    weights, ids = route(torch.randn(37, 6), top_k=2, normalise=normalise)
    grouped = experts(x, weights, ids)
    torch.testing.assert_close(experts.dense(x, weights, ids), grouped, rtol=1e-5, atol=1e-4)
    # Reference: every token's experts one by one.
    ref = torch.zeros_like(x)
    for t in range(37):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            ref[t] += w * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-4)
    if not normalise:
        assert not torch.allclose(weights.sum(-1), torch.ones(37))
