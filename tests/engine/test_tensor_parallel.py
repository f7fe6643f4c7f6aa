"""Tensor parallelism over 2 gloo ranks on the CPU: greedy tokens equal ``tensor_parallel_size=1``
on tiny Llama, Mistral (sliding window), Qwen2 (QKV bias) and Qwen3 (q/k norms), with KV heads
split (2 over 2 ranks) and replicated (1 KV head on both ranks), with an uneven split of heads
(the embedded model's 9 heads / 3 KV heads), mixtures of experts (every expert's features
split), with preemption that swaps blocks out to every rank's host pool and back, with grammar-constrained rows under speculation, and on the
embedded SmolLM2-135M (slow). Each rank runs one thread.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir

CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 6}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-1kv": ("llama", {"num_key_value_heads": 1}),
    "qwen3-1kv": ("qwen3", {"num_key_value_heads": 1}),
    "llama-9-heads-3kv-tied": ("llama", {"num_attention_heads": 9, "num_key_value_heads": 3,
                                         "hidden_size": 144, "tie_word_embeddings": True}),
}
BASE = dict(dtype="float32", block_size=4, kv_cache_memory="8MiB", num_threads=1,
            distributed_timeout=30)


def _workload(seed: int, n: int = 8):
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    return prompts, [rng.randint(1, 16) for _ in range(n)]


def _greedy(llm: LLM, prompts, lengths) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    prompts, lengths = _workload(list(CASES).index(request.param))
    with LLM(str(path), **BASE) as llm:
        expected = _greedy(llm, prompts, lengths)
    return path, prompts, lengths, expected


def test_two_ranks_give_the_same_greedy_tokens(case):
    path, prompts, lengths, expected = case
    with LLM(str(path), tensor_parallel_size=2, **BASE) as llm:
        assert _greedy(llm, prompts, lengths) == expected
        # again, now with the prompts' blocks in the prefix cache
        assert _greedy(llm, prompts[:3], lengths[:3]) == expected[:3]
        assert llm.stats()["prefix_cache_hits"] > 0
        llm.engine.kv.check_integrity()


def test_experts_split_over_two_ranks(tmp_path):
    """Mixture of experts over 2 ranks: each rank holds every expert's slice of the
    intermediate features (an uneven split: 23 / 24; a dense layer among the sparse ones),
    the router replicated: greedy tokens equal one rank's. (Mixtral: the GGUF test below.)"""
    path = make_tiny_model_dir(tmp_path / "moe", "qwen3_moe", moe_intermediate_size=47)
    prompts, lengths = _workload(11)
    with LLM(str(path), **BASE) as llm:
        expected = _greedy(llm, prompts, lengths)
    with LLM(str(path), tensor_parallel_size=2, **BASE) as llm:
        assert _greedy(llm, prompts, lengths) == expected


def test_gguf_experts_split_over_two_ranks(tmp_path):
    """A Mixtral GGUF (Q4_0/Q8_0 experts, dequantised under tensor parallelism): two ranks'
    greedy tokens equal one rank's at quantization=none. (Its one-time conversion goes to the
    usual cache, keyed by the file's contents; a temporary KVSERVE_CACHE_DIR would make every
    rank compile the CPU kernels again.)"""
    from engine.loading.tiny_gguf import write_moe_gguf

    path = tmp_path / "tiny-mixtral.gguf"
    write_moe_gguf(path, "mixtral")
    prompts, lengths = _workload(12, n=4)
    with LLM(str(path), quantization="none", **BASE) as llm:
        expected = _greedy(llm, prompts, lengths)
    with LLM(str(path), tensor_parallel_size=2, **BASE) as llm:
        assert _greedy(llm, prompts, lengths) == expected


def test_ngram_speculation_rows_reach_every_rank(tmp_path):
    """Drafted tokens travel in the step plan (``SeqChunk.num_draft``): a repetitive prompt
    gets drafts accepted, and the tokens equal one rank's plain greedy decoding."""
    path = make_tiny_model_dir(tmp_path / "m", "qwen2")
    prompts = [[5, 6, 7, 8] * 6, [40, 41, 42] * 8]
    lengths = [16, 16]
    with LLM(str(path), **BASE) as llm:
        expected = _greedy(llm, prompts, lengths)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "disable_by_batch_size": None}
    with LLM(str(path), tensor_parallel_size=2, speculative_config=spec, **BASE) as llm:
        assert _greedy(llm, prompts, lengths) == expected
        assert llm.engine.spec_counters.snapshot().num_draft_tokens > 0



def test_constrained_rows_with_drafts_match_one_rank(tmp_path):
    """Matchers live on rank 0 (the core samples): a grammar-constrained batch, drafted by
    n-gram speculation, gives one rank's plain constrained greedy tokens."""
    from engine.params.structured import StructuredSpec

    path = make_tiny_model_dir(tmp_path / "m", "llama")
    prompts = [[5, 6, 7, 8] * 6, list(b"ab ab ab ")]
    params = [SamplingParams(temperature=0, max_tokens=24,
                             structured=StructuredSpec.text("regex", "([ab]{1,3} ){3,6}x")),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    with LLM(str(path), **BASE) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "disable_by_batch_size": None}
    with LLM(str(path), tensor_parallel_size=2, speculative_config=spec, **BASE) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.stats()["structured_constrained_rows"] > 0

def test_swap_preemption_moves_blocks_on_every_rank(tmp_path):
    path = make_tiny_model_dir(tmp_path / "m", "llama")
    prompts, lengths = _workload(7, n=10)
    per_token = 2 * 2 * 1 * 16 * 4  # layers x one KV head per rank x head_dim x float32
    pool = dict(BASE, kv_cache_memory=per_token * 4 * 16, preemption_mode="swap",
                swap_space=per_token * 4 * 256 / 2**30)
    with LLM(str(path), **BASE) as llm:
        expected = _greedy(llm, prompts, lengths)
    with LLM(str(path), tensor_parallel_size=2, **pool) as llm:
        assert llm.engine.runner.num_blocks == 16
        assert _greedy(llm, prompts, lengths) == expected
        stats = llm.stats()
        assert stats["num_preemptions_swap"] > 0 and stats["offload_blocks_h2d"] > 0


def test_pool_size_is_the_minimum_over_ranks(tmp_path):
    """9 heads / 3 KV heads: rank 0 holds 1 KV head, rank 1 holds 2, so with the same bytes
    rank 1 fits half the blocks; both pools get rank 1's count."""
    path = make_tiny_model_dir(tmp_path / "m", "llama", **CASES["llama-9-heads-3kv-tied"][1])
    per_token_rank1 = 2 * 2 * 2 * 16 * 4
    with LLM(str(path), tensor_parallel_size=2,
             **dict(BASE, kv_cache_memory=per_token_rank1 * 4 * 10)) as llm:
        assert llm.engine.runner.num_blocks == 10
        assert llm.engine.runner.kv_caches[0][0].shape[:3] == (10, 4, 1)


def test_int8_shards_agree_with_one_rank(tmp_path):
    """int8 quantises each rank's shard (the same groups as one rank, see
    tests/engine/distributed/test_tp_reduce_points.py); the kernels' int8 activations can turn the
    all-reduce's 1e-6 differences into one int8 step, so tokens are compared teacher-forced:
    along one rank's greedy continuation, two ranks pick the same top-1 almost everywhere."""
    from loadgen.teacher_forced import forced

    path = make_tiny_model_dir(tmp_path / "m", "llama", **CASES["llama-9-heads-3kv-tied"][1])
    prompts, lengths = _workload(11, n=4)
    cfg = dict(BASE, quantization="int8")
    with LLM(str(path), **cfg) as llm:
        bound = llm.engine.token_id_bound  # the model may pick ids the tokenizer lacks
        seqs = [p + t[:next((i for i, x in enumerate(t) if x >= bound), len(t))]
                for p, t in zip(prompts, _greedy(llm, prompts, lengths))]
    with LLM(str(path), tensor_parallel_size=2, **cfg) as llm:
        ranks = [r for p, s in zip(prompts, seqs) if len(s) > len(p)
                 for r, _ in forced(llm, s, start=len(p))]
    assert len(ranks) >= 10 and sum(r == 1 for r in ranks) >= 0.9 * len(ranks)


@pytest.mark.slow
def test_embedded_model_two_ranks_match_one(smollm2_files):
    """SmolLM2-135M (9 heads, 3 KV heads, tied embeddings) in float32. TP=1 with
    ``quantization="none"``: under TP the GGUF's packed blocks are dequantised, as "none" does."""
    cfg = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, num_threads=1,
               quantization="none")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time there"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(None, **cfg) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(None, tensor_parallel_size=2, **cfg) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
