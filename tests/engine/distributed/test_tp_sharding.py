"""Tensor-parallel sharding arithmetic (engine/models/tp_sharding.py, weights.py) and the reduce
points of the model: which slice each rank loads, that the slices put back together are the
whole tensor, and that a rank's partial results add up to the unsharded model's. No processes:
the collectives are played by a recording fake group."""

from __future__ import annotations

import pytest
import torch

from engine.distributed.weights import shard_tensor
from engine.loading.tiny import tiny_config
from engine.models.arch import ModelArch
from engine.models.tp_sharding import (
    check_tensor_parallel,
    even_range,
    local_arch,
    rank_shard,
)


def _arch(**overrides) -> ModelArch:
    return ModelArch.from_hf_config(tiny_config("llama", **overrides))


SMOLLM2 = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


def test_even_ranges_cover_without_overlap():
    for size in (1, 7, 9, 260, 49152):
        for world in range(1, min(size, 8) + 1):
            spans = [even_range(size, r, world) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


def test_smollm2_heads_follow_their_kv_groups_over_two_ranks():
    arch = _arch(**SMOLLM2)
    r0, r1 = rank_shard(arch, 0, 2), rank_shard(arch, 1, 2)
    assert (r0.kv_heads, r0.q_heads) == ((0, 1), (0, 3))  # 3 query heads per KV head
    assert (r1.kv_heads, r1.q_heads) == ((1, 3), (3, 9))
    assert (r0.intermediate, r1.intermediate) == ((0, 768), (768, 1536))
    assert (r0.vocab, r1.vocab) == ((0, 24576), (24576, 49152))
    assert r0.vocab_sizes == [24576, 24576]
    loc = local_arch(arch, r1)
    assert (loc.num_heads, loc.num_kv_heads, loc.intermediate_size) == (6, 2, 768)
    assert loc.vocab_size == 49152 and loc.hidden_size == 576


def test_fewer_kv_heads_than_ranks_replicates_them():
    arch = _arch(num_attention_heads=8, num_key_value_heads=2)
    shards = [rank_shard(arch, r, 4) for r in range(4)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    one = _arch(num_attention_heads=4, num_key_value_heads=1)
    assert [rank_shard(one, r, 2).kv_heads for r in range(2)] == [(0, 1), (0, 1)]
    assert [rank_shard(one, r, 2).q_heads for r in range(2)] == [(0, 2), (2, 4)]


@pytest.mark.parametrize("heads,kv,world,match", [
    (4, 2, 8, "larger than the model's 4 attention heads"),
    (6, 2, 3, "multiple of the model's 2 KV heads"),
    (4, 4, 0, ">= 1"),
])
def test_impossible_splits_are_refused_with_a_reason(heads, kv, world, match):
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(_arch(num_attention_heads=heads, num_key_value_heads=kv,
                                    hidden_size=16 * heads), world)


def test_weight_slices_per_tensor():
    arch = _arch(**SMOLLM2)
    r1 = rank_shard(arch, 1, 2)
    d = arch.head_dim  # 64
    assert r1.weight_slice("model.layers.0.self_attn.q_proj.weight") == (0, 3 * d, 9 * d)
    assert r1.weight_slice("model.layers.0.self_attn.k_proj.weight") == (0, 1 * d, 3 * d)
    assert r1.weight_slice("model.layers.0.self_attn.v_proj.bias") == (0, 1 * d, 3 * d)
    assert r1.weight_slice("model.layers.0.self_attn.o_proj.weight") == (1, 3 * d, 9 * d)
    assert r1.weight_slice("model.layers.0.mlp.gate_proj.weight") == (0, 768, 1536)
    assert r1.weight_slice("model.layers.0.mlp.up_proj.weight") == (0, 768, 1536)
    assert r1.weight_slice("model.layers.0.mlp.down_proj.weight") == (1, 768, 1536)
    assert r1.weight_slice("model.embed_tokens.weight") == (0, 24576, 49152)
    assert r1.weight_slice("lm_head.weight") == (0, 24576, 49152)
    for replicated in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                       "model.layers.0.self_attn.q_norm.weight"):
        assert r1.weight_slice(replicated) is None
    # Row-parallel biases are added once, after the reduction: rank 0 keeps them.
    assert rank_shard(arch, 0, 2).weight_slice("model.layers.0.mlp.down_proj.bias") is None
    assert r1.weight_slice("model.layers.0.mlp.down_proj.bias") == "zero"
    assert r1.weight_slice("model.layers.0.self_attn.o_proj.bias") == "zero"


@pytest.mark.parametrize("name,dim", [("model.layers.1.self_attn.q_proj.weight", 0),
                                      ("model.layers.1.self_attn.o_proj.weight", 1),
                                      ("model.layers.1.mlp.down_proj.weight", 1),
                                      ("model.embed_tokens.weight", 0)])
def test_rank_slices_put_back_together_are_the_whole_tensor(name, dim):
    arch = _arch(**SMOLLM2)
    shapes = {"q_proj": (576, 576), "o_proj": (576, 576), "down_proj": (576, 1536),
              "embed_tokens": (49152, 576)}
    full = torch.randn(shapes[name.split(".")[-2]])
    parts = [shard_tensor(name, full, rank_shard(arch, r, 2)) for r in range(2)]
    torch.testing.assert_close(torch.cat(parts, dim=dim), full, rtol=0, atol=0)


def test_safetensors_slices_are_read_not_the_whole_tensor(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    arch = _arch(**SMOLLM2)
    w = torch.randn(576, 1536)
    save_file({"model.layers.0.mlp.down_proj.weight": w}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        part = shard_tensor("model.layers.0.mlp.down_proj.weight",
                            f.get_slice("model.layers.0.mlp.down_proj.weight"),
                            rank_shard(arch, 1, 2))
    assert part.shape == (576, 768)
    torch.testing.assert_close(part, w[:, 768:], rtol=0, atol=0)


@pytest.mark.parametrize("read", ["tensor", "safetensors"])
def test_expert_slices_put_back_together(tmp_path, read):
    """Every expert split over its own intermediate features (47: 23 + 24): stacked gate/up
    [E, 2I, H] as each rank's gate rows then up rows, stacked down [E, H, I] by columns,
    per-expert tensors (both HF spellings) like the dense MLP, the router whole."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    arch = ModelArch.from_hf_config(tiny_config("qwen3_moe", moe_intermediate_size=47))
    assert check_tensor_parallel(arch, 2) is None
    shards = [rank_shard(arch, r, 2) for r in range(2)]
    assert [s.expert_intermediate for s in shards] == [(0, 23), (23, 47)]
    assert [local_arch(arch, s).moe.expert_intermediate for s in shards] == [23, 24]
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(8, 94, 64),
               "model.layers.0.mlp.experts.down_proj": torch.randn(8, 64, 47),
               "model.layers.0.mlp.experts.3.up_proj.weight": torch.randn(47, 64),
               "model.layers.0.block_sparse_moe.experts.3.w2.weight": torch.randn(64, 47),
               "model.layers.0.mlp.gate.weight": torch.randn(8, 64)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        parts = {n: [shard_tensor(n, t if read == "tensor" else f.get_slice(n), s)
                     for s in shards] for n, t in tensors.items()}
    gate_up = parts["model.layers.0.mlp.experts.gate_up_proj"]
    assert [p.shape for p in gate_up] == [(8, 46, 64), (8, 48, 64)]
    full = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(torch.cat([gate_up[0][:, :23], gate_up[1][:, :24]], 1),
                               full[:, :47], rtol=0, atol=0)  # the gate rows
    torch.testing.assert_close(torch.cat([gate_up[0][:, 23:], gate_up[1][:, 24:]], 1),
                               full[:, 47:], rtol=0, atol=0)  # the up rows
    for name, dim in (("model.layers.0.mlp.experts.down_proj", 2),
                      ("model.layers.0.mlp.experts.3.up_proj.weight", 0),
                      ("model.layers.0.block_sparse_moe.experts.3.w2.weight", 1)):
        torch.testing.assert_close(torch.cat(parts[name], dim), tensors[name], rtol=0, atol=0)
    for part in parts["model.layers.0.mlp.gate.weight"]:
        torch.testing.assert_close(part, tensors["model.layers.0.mlp.gate.weight"])
    with pytest.raises(ValueError, match="experts' 1 intermediate"):
        check_tensor_parallel(ModelArch.from_hf_config(
            tiny_config("qwen3_moe", moe_intermediate_size=1)), 2)
