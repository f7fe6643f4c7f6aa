"""The engine over 8-bit and 16-bit KV pools (``kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2 /
float16 / bfloat16) under a float32 tiny random Llama: the pool is what kv-calc says, agreement
with the exact cache, swap preemption and the host tier moving blocks with their scales, prefix
hits, fp8 calibration, and the CLI flag. The real model's accuracy figures are in tests/engine/test_smollm2.py (slow).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from loadgen.kv_calc import kv_bytes_per_token
from loadgen.teacher_forced import top1

BS = 4
KINDS = ["int8", "int4", "fp8_e4m3", "fp8_e5m2"]
HALF = ["float16", "bfloat16"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 32 (a multiple of 16): the CPU decode kernel's vector path.
    return make_tiny_model_dir(tmp_path_factory.mktemp("kvq"), "llama", hidden_size=128,
                               intermediate_size=256)


def _llm(path, **kw) -> LLM:
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory="4MiB")
    cfg.update(kw)
    return LLM(str(path), **cfg)


def _prompts(n=6, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _agreement(llm: LLM, ids_list, reference) -> float:
    """Teacher-forced top-1 agreement with ``reference`` (lists of top-1 hits per position)."""
    same = total = 0
    for ids, ref in zip(ids_list, reference):
        got = top1(llm, ids)
        same += sum(a == b for a, b in zip(got, ref))
        total += len(ref)
    return same / total


@pytest.mark.parametrize("kind", KINDS)
def test_pool_holds_what_kv_calc_counts(tiny, kind):
    exact, quant = _llm(tiny), _llm(tiny, kv_cache_dtype=kind)
    r, q = exact.engine.runner, quant.engine.runner
    shape = r.arch.shape
    assert q.kv_bytes_per_token == kv_bytes_per_token(shape, kind)
    assert q.kv_pool_bytes() == q.num_blocks * BS * q.kv_bytes_per_token
    # 4 MiB of float32 K/V vs the same 4 MiB of 8-bit rows (int8: + 2 scale bytes per 32).
    assert q.num_blocks >= 3.5 * r.num_blocks
    assert quant.stats()["kv_bytes_per_token"] == q.kv_bytes_per_token


@pytest.mark.parametrize("kind", HALF)
def test_16bit_pool_halves_float32_and_decodes_on_the_kernel(tiny, kind, monkeypatch):
    """Half float32's bytes per token, twice its blocks, and decodes on the compiled CPU kernel
    (the Python layer loop's path; the C++ stack's is tests/engine/models/test_decode_stack.py)."""
    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    exact, half = _llm(tiny), _llm(tiny, kv_cache_dtype=kind)
    r, h = exact.engine.runner, half.engine.runner
    assert h.kv_caches[0][0].dtype == getattr(torch, kind)
    assert h.kv_bytes_per_token == kv_bytes_per_token(r.arch.shape, kind) \
        == r.kv_bytes_per_token // 2
    assert h.num_blocks >= 1.9 * r.num_blocks
    backend = h.backend
    calls = []
    kernel = backend._cpu_kernels()
    assert kernel is not None

    class Spy:
        def __getattr__(self, name):
            fn = getattr(kernel, name)
            if name != "paged_decode_cpu":
                return fn
            return lambda *a, **kw: calls.append(a[1].dtype) or fn(*a, **kw)

    backend._cpu_kernel = Spy()
    half.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4))
    assert calls and set(calls) == {h.kv_caches[0][0].dtype}


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8_e4m3", *HALF])
def test_teacher_forced_agreement_with_the_exact_cache(tiny, kind):
    """Chunks of 4 tokens: every chunk after the first attends over the 8-bit cache."""
    ids_list = [p + p[::-1] for p in _prompts()]
    exact = _llm(tiny, max_num_batched_tokens=4, max_model_len=128)
    reference = [top1(exact, ids) for ids in ids_list]
    quant = _llm(tiny, max_num_batched_tokens=4, max_model_len=128, kv_cache_dtype=kind,
                 calculate_kv_scales=kind.startswith("fp8"))
    assert _agreement(quant, ids_list, reference) >= 0.95


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8_e4m3", "float16"])
def test_swap_preemption_and_host_tier_move_quantised_blocks_exactly(tiny, kind):
    """A pool small enough to preempt (swap mode, host tier on) gives the same greedy tokens
    as a pool that never preempts: blocks and their scales travel bit-exactly."""
    prompts = _prompts(8, seed=11)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = _llm(tiny, kv_cache_dtype=kind)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    block_bytes = roomy.engine.runner.kv_bytes_per_token * BS
    tight = _llm(tiny, kv_cache_dtype=kind, kv_cache_memory=24 * block_bytes,
                 swap_space=64 * block_bytes / 2**30, preemption_mode="swap")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.stats()["num_preemptions_swap"] > 0
    assert got == expected


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_recompute_preemption_over_a_quantised_pool_finishes_and_frees(tiny, kind):
    """Recompute preemption over a quantised pool: every request finishes with its tokens,
    every block comes back, and greedy output matches the roomy pool's (the recomputed
    prompt is prefilled in chunks that attend over the quantised cache, as decode does)."""
    prompts = _prompts(8, seed=11)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = _llm(tiny, kv_cache_dtype=kind, max_num_batched_tokens=4, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    block_bytes = roomy.engine.runner.kv_bytes_per_token * BS
    tight = _llm(tiny, kv_cache_dtype=kind, kv_cache_memory=24 * block_bytes,
                 max_num_batched_tokens=4, max_model_len=128, preemption_mode="recompute")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    s = tight.stats()
    assert s["num_preemptions_recompute"] > 0 and s["num_blocks_used"] == 0
    assert [len(g) for g in got] == [24] * len(prompts)
    assert got == expected


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_prefix_hits_read_the_quantised_blocks(tiny, kind):
    llm = _llm(tiny, kv_cache_dtype=kind)
    shared = list(range(40, 72))  # 8 full blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([shared + [1, 2]], params)[0]
    second = llm.generate([shared + [1, 2]], params)[0]
    assert second.num_cached_tokens >= 32
    # The hit attends over the quantised prefix where the first prompt attended over exact K/V:
    # near-identical, and on this model identical.
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_fp8_calibration_sets_per_head_scales(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        llm = _llm(tiny, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    layers = llm.engine.runner.model.layers
    for layer in layers:
        ks, vs = layer.kv_scales
        assert ks.shape == (2,) and (ks > 0).all() and (vs > 0).all()
        assert layer.kv_observer is None
    assert "KV scales calibrated" in caplog.text
    assert "KV cache (fp8_e4m3)" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_int4_calibration_smooths_keys_per_channel(tiny, caplog):
    """int4 + calculate_kv_scales: per layer a [KVH, D] key smoothing (mean 1 per head), no
    value entry; the engine still agrees with the exact cache (chunks attend over the pool,
    through the compiled decode kernel with the query multiplied by the smoothing)."""
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        llm = _llm(tiny, kv_cache_dtype="int4", calculate_kv_scales=True,
                   max_num_batched_tokens=4, max_model_len=128)
    assert "int4 key smoothing" in caplog.text
    for layer in llm.engine.runner.model.layers:
        ks, vs = layer.kv_scales
        assert ks.shape == (2, 32) and vs is None and (ks > 0).all()
        torch.testing.assert_close(ks.mean(dim=-1), torch.ones(2))
    ids_list = [p + p[::-1] for p in _prompts()]
    exact = _llm(tiny, max_num_batched_tokens=4, max_model_len=128)
    reference = [top1(exact, ids) for ids in ids_list]
    assert _agreement(llm, ids_list, reference) >= 0.95


def test_cli_flags_reach_the_engine_config():
    from server.cli import _settings, build_parser

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2",
                                      "--calculate-kv-scales"])
    cfg, _ = _settings(args)
    assert cfg.kv_cache_dtype == "fp8_e5m2" and cfg.calculate_kv_scales
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int2"])
