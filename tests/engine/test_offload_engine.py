"""The host KV tier end to end: greedy outputs equal HF transformers' with swap preemption,
recompute preemption and no preemption; a prefix pushed out of the device comes back from the
host instead of being recomputed; host pool pressure; abort while swapped; swap_space=0.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache import KVCacheManager
from engine.loading.hf_reference import hf_greedy, load_hf
from engine.loading.tiny import make_tiny_model_dir

BS = 4


@pytest.fixture(scope="module", params=["llama", "mistral"])
def tiny(request, tmp_path_factory):
    # A window longer than any sequence here (<= 60 tokens): with a short one, sequences give
    # their blocks back as they grow and this workload would never preempt. Swap and
    # recompute under a window that releases blocks: tests/engine/test_sliding_window_release.py.
    extra = {"sliding_window": 64} if request.param == "mistral" else {}
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, **extra)
    hf = load_hf(path)
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    lengths = [rng.randint(1, 20) for _ in range(12)]
    expected = [hf_greedy(hf, p, k) for p, k in zip(prompts, lengths)]
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    block_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4 * BS
    return path, hf, prompts, lengths, expected, block_bytes


def _engine(tiny, device_blocks: int, host_blocks: int, **overrides) -> LLM:
    path, *_, block_bytes = tiny
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory=device_blocks * block_bytes,
               swap_space=host_blocks * block_bytes / 2**30)
    cfg.update(overrides)
    return LLM(str(path), **cfg)


def _greedy(llm: LLM, prompts, lengths):
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_clean(llm: LLM) -> None:
    """Everything finished: no block held in either pool, both pools consistent."""
    llm.engine.kv.check_integrity()
    s = llm.stats()
    assert s["num_blocks_used"] == 0 and s["host_blocks_used"] == 0
    assert s["num_swapped_seqs"] == 0


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto", "big-pool"])
def test_outputs_equal_hf_under_every_preemption_mode(tiny, mode):
    _, _, prompts, lengths, expected, _ = tiny
    if mode == "big-pool":
        llm = _engine(tiny, device_blocks=4096, host_blocks=64)
    else:  # 16 device blocks of 4 tokens: far less than 12 concurrent sequences need
        llm = _engine(tiny, device_blocks=16, host_blocks=256, preemption_mode=mode)
    assert llm.engine.kv.host is not None  # the host tier is on
    assert _greedy(llm, prompts, lengths) == expected
    s = llm.stats()
    assert s["num_preemptions"] == s["num_preemptions_swap"] + s["num_preemptions_recompute"]
    if mode == "big-pool":
        assert s["num_preemptions"] == 0
    elif mode == "recompute":
        assert s["num_preemptions_recompute"] > 0 and s["num_preemptions_swap"] == 0
    else:  # auto: on a CPU the copy is far cheaper than recomputing, so it swaps too
        assert s["num_preemptions_swap"] > 0 and s["offload_blocks_d2h"] > 0
        assert s["offload_blocks_h2d"] > 0
        assert s["offload_bytes_d2h"] == s["offload_blocks_d2h"] * tiny[-1]
    _assert_clean(llm)


def test_swap_keeps_n_samples_sharing_their_prompt(tiny):
    _, _, prompts, lengths, expected, _ = tiny
    llm = _engine(tiny, device_blocks=16, host_blocks=256, preemption_mode="swap")
    params = [SamplingParams(n=3, temperature=0, max_tokens=k, ignore_eos=True)
              for k in lengths[:4]]
    outs = llm.generate(prompts[:4], params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == \
        [[e] * 3 for e in expected[:4]]
    _assert_clean(llm)


def _pushed_out_prefix_run(tiny, host_blocks: int):
    """A 40-token prefix is computed, pushed out of a 16-block device pool by other traffic,
    then asked for again. Returns the second request's output and the tokens it computed."""
    _, hf, *_ = tiny
    system = list(range(100, 140))  # 10 full blocks
    first, again = system + [7, 1, 9], system + [7, 2, 9, 11]
    others = [[200 + (i * 7 + k) % 50 for k in range(56)] for i in range(2)]
    llm = _engine(tiny, device_blocks=16, host_blocks=host_blocks)
    assert _greedy(llm, [first], [4]) == [hf_greedy(hf, first, 4)]
    for other in others:  # one at a time: each takes 15 blocks, evicting the prefix
        _greedy(llm, [other], [3])
    before = llm.stats()
    out = llm.generate([again], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    after = llm.stats()
    assert out.outputs[0].token_ids == hf_greedy(hf, again, 5)
    llm.engine.kv.check_integrity()
    return out, after["computed_tokens"] - before["computed_tokens"], before, after


def test_prefix_pushed_out_of_the_device_comes_back_from_the_host(tiny):
    out_off, computed_off, _, _ = _pushed_out_prefix_run(tiny, host_blocks=0)
    assert out_off.num_cached_tokens == 0  # the traffic did push it out of the device
    out_on, computed_on, before, after = _pushed_out_prefix_run(tiny, host_blocks=64)
    assert out_on.num_cached_tokens == 40
    assert computed_off - computed_on == 40  # the prefill dropped by the prefix length
    assert out_on.outputs[0].token_ids == out_off.outputs[0].token_ids
    assert after["prefix_cache_host_hits"] - before["prefix_cache_host_hits"] == 40
    assert after["offload_blocks_h2d"] - before["offload_blocks_h2d"] == 10
    assert before["offload_spills"] >= 10 and before["host_blocks_cached"] >= 10


def test_host_pool_pressure_evicts_lru_and_outputs_hold(tiny):
    _, _, prompts, lengths, expected, _ = tiny
    # 12 host blocks: too few for the spills and swaps of this workload.
    llm = _engine(tiny, device_blocks=16, host_blocks=12, preemption_mode="swap")
    assert _greedy(llm, prompts, lengths) == expected
    assert _greedy(llm, prompts[::-1], lengths[::-1]) == expected[::-1]
    s = llm.stats()
    assert s["host_evictions"] > 0 and s["host_blocks_total"] == 12
    assert s["num_preemptions_swap"] > 0
    _assert_clean(llm)


def test_abort_while_swapped_out_leaves_nothing_behind(tiny):
    _, _, prompts, lengths, expected, _ = tiny
    llm = _engine(tiny, device_blocks=16, host_blocks=256, preemption_mode="swap")
    core = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(str(i), p, sp)
    victim = None
    for _ in range(500):
        core.step()
        swapped = [s for s in core.scheduler.waiting if core.kv.is_swapped(s.seq_id)]
        if swapped:
            victim = swapped[0].request.request_id
            break
    assert victim is not None, "the workload never swapped"
    assert core.stats().host.host_blocks_used > 0
    core.abort_request([victim])
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[victim].outputs[0].finish_reason == "abort"
    for rid, out in finished.items():
        if rid != victim:
            assert out.outputs[0].token_ids == expected[int(rid)]
    _assert_clean(llm)


def test_swap_space_zero_is_todays_engine(tiny):
    _, _, prompts, lengths, expected, _ = tiny
    llm = _engine(tiny, device_blocks=16, host_blocks=0, preemption_mode="swap")
    assert type(llm.engine.kv) is KVCacheManager and llm.engine.kv.host is None
    assert llm.engine.runner.host_kv_caches == []
    assert _greedy(llm, prompts, lengths) == expected
    s = llm.stats()
    assert s["num_preemptions"] == s["num_preemptions_recompute"] > 0  # swap falls back
    assert s["host_blocks_total"] == s["offload_blocks_d2h"] == s["prefix_cache_host_hits"] == 0
