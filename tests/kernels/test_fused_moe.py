"""The fused MoE kernels (kvserve_kernels/fused_moe.py) against the per-expert loop
(engine.models.moe.grouped_moe) and, end to end, a tiny MoE model on the fused path against HF.
On a CPU the kernels run in Triton's interpreter: small shapes."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import DEVICE

pytest.importorskip("triton")
from engine.models.layer_ops import TorchLayerOps  # noqa: E402
from engine.models.moe import MoeExperts, grouped_moe, route  # noqa: E402
from kvserve_kernels.fused_moe import align_by_expert, fused_moe, moe_tiles  # noqa: E402

OPS = TorchLayerOps()


def _case(t, e, k, h, i, dtype=torch.float32, seed=0, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w_gate_up = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w_down = torch.randn(e, h, i, generator=g) / i ** 0.5
    logits = torch.randn(t, e, generator=g)
    logits[:, 0] += skew  # skew > 0: most tokens pick expert 0; the last experts get few
    weights, ids = route(logits, k, normalise=True)
    return [v.to(DEVICE) for v in (x.to(dtype), weights, ids, w_gate_up.to(dtype),
                                   w_down.to(dtype))]


def _loop(x, weights, ids, w_gate_up, w_down):
    return grouped_moe(x, weights, ids, w_gate_up.shape[0],
                       lambda e, r: F.linear(r, w_gate_up[e]), lambda e, r: F.linear(r, w_down[e]),
                       OPS)


@pytest.mark.parametrize("t,e,k,h,i,skew", [
    (1, 6, 2, 32, 24, 0.0),      # one decode row
    (5, 8, 3, 40, 24, 0.0),      # ragged hidden / intermediate (not tile multiples)
    (37, 6, 2, 64, 48, 0.0),
    (37, 16, 2, 32, 16, 6.0),    # one expert takes most rows, several take none
    (130, 4, 2, 32, 16, 0.0),    # 260 pairs: the larger tiles
])
def test_fused_equals_the_per_expert_loop_float32(t, e, k, h, i, skew):
    x, weights, ids, w_gate_up, w_down = _case(t, e, k, h, i, skew=skew)
    got = fused_moe(x, weights, ids, w_gate_up, w_down, OPS.silu_mul)
    torch.testing.assert_close(got, _loop(x, weights, ids, w_gate_up, w_down),
                               rtol=1e-5, atol=1e-5)


def test_fused_bfloat16_rounds_as_the_loop():
    x, weights, ids, w_gate_up, w_down = _case(9, 6, 2, 64, 32, dtype=torch.bfloat16)
    got = fused_moe(x, weights, ids, w_gate_up, w_down, OPS.silu_mul)
    assert got.dtype == torch.bfloat16
    expected = _loop(x, weights, ids, w_gate_up, w_down)
    # One bf16 ulp at these magnitudes: the two GEMMs sum their products in another order.
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)


def test_no_tokens():
    x, weights, ids, w_gate_up, w_down = _case(0, 4, 2, 32, 16)
    assert fused_moe(x, weights, ids, w_gate_up, w_down, OPS.silu_mul).shape == (0, 32)


@pytest.mark.parametrize("t,e,k,block_m", [(1, 128, 8, 16), (7, 5, 2, 16), (300, 8, 2, 64)])
def test_align_by_expert_lays_out_every_pair_once(t, e, k, block_m):
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(s))[:k]
                       for s in range(t)]).to(DEVICE)
    pairs, block_expert, total = align_by_expert(ids, e, block_m)
    pairs, block_expert, total = pairs.cpu(), block_expert.cpu(), int(total)
    p = t * k
    assert pairs.numel() % block_m == 0 and total % block_m == 0 and total <= pairs.numel()
    assert pairs.numel() <= min(p + e * (block_m - 1), p * block_m) + block_m
    used = pairs[:total]
    assert sorted(used[used < p].tolist()) == list(range(p))  # each pair exactly once
    assert bool((pairs[total:] == p).all())  # the rest is padding
    flat = ids.reshape(-1).cpu()
    for b in range(total // block_m):
        rows = used[b * block_m:(b + 1) * block_m]
        real = rows[rows < p]
        assert len(real) > 0  # no block of padding only below the total
        assert bool((flat[real.long()] == block_expert[b]).all())
        assert real.tolist() == sorted(real.tolist())  # stable: token order kept
    experts = block_expert[:total // block_m].tolist()
    assert experts == sorted(experts)


def test_moe_tiles_grow_with_the_pairs():
    assert moe_tiles(8)[0] < moe_tiles(4096)[0]


def test_experts_module_paths_agree():
    torch.manual_seed(0)
    experts = MoeExperts(num_experts=6, hidden=32, intermediate=24).to(DEVICE)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(11, 32, device=DEVICE)
    weights, ids = route(torch.randn(11, 6, device=DEVICE), top_k=2, normalise=False)
    out = {}
    for path in ("auto", "grouped", "fused", "dense"):
        experts.path = path
        out[path] = experts(x, weights, ids)
    for path in ("grouped", "fused", "dense"):
        torch.testing.assert_close(out[path], out["auto"], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_tiny_model_on_the_fused_path_matches_hf(model_type, tmp_path, monkeypatch):
    """Greedy tokens of a tiny MoE model identical to HF's at float32 with every MoE layer on
    the fused kernels (the Python layer loop: the C++ decode stack runs its own experts)."""
    from engine import LLM, SamplingParams
    from engine.loading.hf_reference import hf_greedy, load_hf
    from engine.loading.tiny import make_tiny_model_dir

    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    path = make_tiny_model_dir(tmp_path, model_type)
    hf = load_hf(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(6, 14))] for _ in range(3)]
    expected = [hf_greedy(hf, p, 5) for p in prompts]
    llm = LLM(str(path), dtype="float32", block_size=4, device=DEVICE.type, enforce_eager=True)
    blocks = llm.engine.runner.model.moe_blocks()
    assert blocks
    for block in blocks.values():
        assert isinstance(block.experts, MoeExperts)
        block.experts.path = "fused"
    import kvserve_kernels.fused_moe as kernels

    calls = []
    monkeypatch.setattr(kernels, "fused_moe",
                        lambda *a, f=kernels.fused_moe: calls.append(1) or f(*a))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert len(calls) >= 5 * len(blocks)  # every MoE layer, at every step
