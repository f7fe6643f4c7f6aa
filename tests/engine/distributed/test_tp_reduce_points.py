"""Where a tensor-parallel forward pass communicates, and that what it adds up is the unsharded
model: two rank runners in one process, on two threads, exchange their partial results through
a fake group (a barrier and a slot per rank) instead of torch.distributed. Each step must make
exactly one all-reduce for the embedding lookup and two per layer (after O, after down), one
vocabulary gather per logits call, and give the unsharded runner's logits."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from engine.config.engine import EngineConfig
from engine.distributed.weights import shard_tensor
from engine.loading.loader import iter_weights, load_config, resolve_model
from engine.loading.tiny import make_tiny_model_dir
from engine.models.tp_sharding import rank_shard
from engine.runner.model_runner import ModelRunner
from engine.step.plan import PromptLogitSpan, SeqChunk, StepPlan


class ThreadGroup:
    """The collectives of ``engine.models.tp_group.TPGroup`` between threads."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls: Counter = Counter()

    def member(self, rank: int, shard) -> _Member:
        return _Member(self, rank, shard)


class _Member:
    def __init__(self, group: ThreadGroup, rank: int, shard) -> None:
        self.g, self.rank, self.world, self.shard = group, rank, group.world, shard

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.g.slots[self.rank] = x.clone()
        self.g.barrier.wait()
        parts = list(self.g.slots)
        self.g.barrier.wait()
        return parts

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            self.g.calls["all_reduce"] += 1
        parts = self._exchange(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return x.copy_(total)

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            self.g.calls["gather_vocab"] += 1
        return torch.cat(self._exchange(local), dim=1)

    def min_int(self, value: int) -> int:
        return value


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp-tiny"), "qwen2",
                               num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                               tie_word_embeddings=True)


def _plan() -> StepPlan:
    prompt = [5, 17, 99, 3, 250, 8, 41, 7, 12]
    return StepPlan(seqs=(
        SeqChunk(token_ids=[11], start=0, block_table=[0], sample=True),
        SeqChunk(token_ids=prompt, start=0, block_table=[1, 2, 3], sample=True,
                 prompt_logits=PromptLogitSpan(0, 8, tuple(prompt[1:]), 2)),
    ), block_size=4)


def test_two_rank_forward_adds_up_to_the_whole_model(tiny_dir):
    torch.manual_seed(0)
    config = EngineConfig(model=str(tiny_dir), dtype="float32", block_size=4,
                          quantization="none")
    files = resolve_model(str(tiny_dir))
    hf = load_config(files)
    whole = ModelRunner(config, hf, iter_weights(files), 64)
    whole.allocate_kv_cache(num_blocks=8)
    expected = whole.execute(_plan())

    group = ThreadGroup(2)
    runners: list[ModelRunner | None] = [None, None]
    results: list = [None, None]
    arch = whole.model.arch

    def rank(r: int) -> None:
        shard = rank_shard(arch, r, 2)
        weights = ((n, shard_tensor(n, t, shard)) for n, t in iter_weights(files))
        runner = ModelRunner(config, hf, weights, 64, tp=group.member(r, shard))
        runner.allocate_kv_cache(num_blocks=8)
        runners[r] = runner
        group.barrier.wait()
        results[r] = runner.execute(_plan())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results)
    layers = arch.num_layers
    # embedding + (O, down) per layer; one gather for the sampled rows, one for prompt logits
    assert group.calls == {"all_reduce": 1 + 2 * layers, "gather_vocab": 2}
    assert runners[0].model.layers[0].num_heads == 2  # 6 heads, 3 KV heads: 2 + 4
    assert runners[1].model.layers[0].num_heads == 4
    for got in results:
        torch.testing.assert_close(got.sample_logits, expected.sample_logits,
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.prompt_logprobs.target_logprobs,
                                   expected.prompt_logprobs.target_logprobs,
                                   rtol=1e-5, atol=1e-5)
    # Every rank's pool holds only its KV heads.
    assert runners[0].kv_caches[0][0].shape[2] == 1 and runners[1].kv_caches[0][0].shape[2] == 2


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quantised_shards_are_slices_of_the_quantised_model(tiny_dir, scheme,
                                                           default_quant_settings):
    """int4/int8 under TP quantise each rank's float shard: row groups are the whole model's
    (column-parallel outputs equal its rows exactly) and the row-parallel split falls on group
    boundaries (partial sums add up to its output). End-to-end tokens may still differ from
    TP=1: the kernels quantise activations to int8 per group, and a 1e-6 change of an input
    (the all-reduce's summation order) can move one activation by an int8 step."""
    from engine.quantization.linear import quant_kernels

    if quant_kernels() is None:
        pytest.skip("the CPU quantised kernels did not build")
    # One set of kernel settings for every runner: each would otherwise measure its own (CI saw
    # int8 shards differ from the whole model's rows when the runners' 8-bit kernels did).
    default_quant_settings()
    config = EngineConfig(model=str(tiny_dir), dtype="float32", block_size=4,
                          quantization=scheme)
    files = resolve_model(str(tiny_dir))
    hf = load_config(files)
    whole = ModelRunner(config, hf, iter_weights(files), 64)
    arch, group = whole.model.arch, ThreadGroup(2)
    d, inter = arch.head_dim, arch.intermediate_size
    ranks = []
    for r in range(2):
        shard = rank_shard(arch, r, 2)
        weights = ((n, shard_tensor(n, t, shard)) for n, t in iter_weights(files))
        ranks.append((shard, ModelRunner(config, hf, weights, 64,
                                         tp=group.member(r, shard)).model))
    # Each runner measured its own kernel settings (e.g. the AVX-512 VNNI 4-bit kernel on one,
    # the base one on another: equal up to float summation order); compare on the same ones.
    for model in [whole.model, *(m for _, m in ranks)]:
        for mod in model.modules():
            if type(mod).__name__ == "QuantLinear":
                mod.choose(q4_kernel="base")
                mod.choose(panel_dtype=torch.float32)
    torch.manual_seed(0)
    full, x = whole.model.layers[0], torch.randn(3, arch.hidden_size)
    assert type(full.qkv_proj).__name__ == "QuantLinear"
    qkv, gate_up = full.qkv_proj(x), full.gate_up_proj(x)
    q_end, k_end = arch.num_heads * d, (arch.num_heads + arch.num_kv_heads) * d
    for s, model in ranks:
        (qa, qb), (ka, kb), (ia, ib) = s.q_heads, s.kv_heads, s.intermediate
        layer = model.layers[0]
        expect = torch.cat([qkv[:, qa * d:qb * d], qkv[:, q_end + ka * d:q_end + kb * d],
                            qkv[:, k_end + ka * d:k_end + kb * d]], 1)
        assert torch.equal(layer.qkv_proj(x), expect)
        assert torch.equal(layer.gate_up_proj(x),
                           torch.cat([gate_up[:, ia:ib], gate_up[:, inter + ia:inter + ib]], 1))
    xo, xd = torch.randn(3, arch.num_heads * d), torch.randn(3, inter)
    o = sum(m.layers[0].o_proj(xo[:, s.q_heads[0] * d:s.q_heads[1] * d]) for s, m in ranks)
    down = sum(m.layers[0].down_proj(xd[:, s.intermediate[0]:s.intermediate[1]])
               for s, m in ranks)
    torch.testing.assert_close(o, full.o_proj(xo), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(down, full.down_proj(xd), rtol=1e-5, atol=1e-4)
