"""The hybrid KV cache (issue 28): a model mixing sliding-window and full-attention layers keeps
one block table per KV group over the shared pool; window groups give back the blocks that slid
out of their window while full groups keep everything. Greedy tokens stay identical to HF
transformers (float32, prompts and generations several windows long) with prefix caching
(device and host-tier hits), recompute and swap preemption and speculative rollback, and the
block accounting holds after every step."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache.groups import plan_kv_groups
from engine.kv_cache.hybrid import HybridKVCacheManager
from engine.loading.hf_reference import hf_greedy, load_hf
from tests.support.tiny_models import make_hybrid_qwen2

BS = 4
WINDOW = 8


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = make_hybrid_qwen2(tmp_path_factory.mktemp("hyb"), WINDOW)
    return path, load_hf(path)


def _llm(path, **kw) -> LLM:
    cfg = dict(dtype="float32", block_size=BS, kv_cache_memory="4MiB", quantization="none")
    cfg.update(kw)
    return LLM(str(path), **cfg)


def _run_checked(llm: LLM, prompts, params) -> list[list[int]]:
    """Generate step by step, checking the block accounting after every step."""
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        core.kv.check_integrity()
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_layout_groups_gemma3_shape():
    layout = plan_kv_groups(tuple([512] * 5 + [None]) * 3)
    assert layout.num_groups == 6 and layout.group_size == 3
    assert sorted(layout.windows, key=str) == [512] * 5 + [None]
    assert plan_kv_groups((None,) * 4).num_groups == 1  # one type: the classic layout
    assert plan_kv_groups((8,) * 4).num_groups == 1


def test_window_groups_stay_flat_and_tokens_match_hf(qwen2):
    path, hf = qwen2
    llm = _llm(path)
    core = llm.engine
    assert core.runner.kv_layout.is_hybrid and isinstance(core.kv, HybridKVCacheManager)
    prompt = list(range(20, 20 + 3 * WINDOW))
    new = 3 * WINDOW
    core.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=new,
                                                 ignore_eos=True))
    seq_id = core.requests["r"].seqs[0].seq_id
    tokens, windowed = None, []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        core.kv.check_integrity()
        if seq_id in core.kv.groups[0]._seqs:
            tables = core.kv.group_tables(seq_id)
            windowed += [sum(b >= 0 for b in t) for t, w in zip(tables, core.kv.windows) if w]
    assert tokens == hf_greedy(hf, prompt, new)
    assert max(windowed[-4:]) <= -(-WINDOW // BS) + 1  # window groups: O(window) blocks
    assert core.kv.num_window_released > 0


def test_prefix_hits_and_both_preemption_modes_match_hf(qwen2):
    path, hf = qwen2
    base = list(range(30, 30 + 4 * WINDOW))
    prompts = [base + [3], base + [4, 5], [7, 8, 9] * 4]
    new = 2 * WINDOW + 2
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    expected = [hf_greedy(hf, p, new) for p in prompts]
    roomy = _llm(path)
    assert _run_checked(roomy, prompts[:1], params) == expected[:1]
    assert _run_checked(roomy, prompts[1:], params) == expected[1:]
    assert roomy.stats()["prefix_cache_hits"] > 0  # the window groups' hit skips old blocks

    page = roomy.engine.runner.kv_page_bytes_per_token * BS
    for mode, swap in (("recompute", 0), ("swap", 0.001)):
        tight = _llm(path, kv_cache_memory=40 * page, swap_space=swap, preemption_mode=mode)
        got = _run_checked(tight, prompts * 2, params)
        assert got == expected * 2, mode
        key = "num_preemptions_swap" if mode == "swap" else "num_preemptions_recompute"
        assert tight.stats()[key] > 0, mode
    # The host tier kept the blocks evicted from the device: a repeat hits them there (each
    # group loads back what it needs) and the tokens stay HF's.
    assert _run_checked(tight, prompts[:2], params) == expected[:2]
    s = tight.stats()  # host hits are hit tokens counted once, not once per group
    assert 0 < s["prefix_cache_host_hits"] <= s["prefix_cache_hits"]


def test_manager_random_ops_keep_integrity():
    rng = random.Random(0)
    for caching in (True, False):
        kv = HybridKVCacheManager(30, BS, plan_kv_groups((None, WINDOW, WINDOW, None, 12, 12)),
                                  caching, num_host_blocks=24)
        live: dict[str, list[int]] = {}
        for step in range(400):
            op = rng.random()
            if op < 0.3 and len(live) < 4:
                sid = f"s{step}"
                toks = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
                hit = kv.find_prefix(sid, toks)
                if kv.allocate(sid, len(toks), hit) is None:
                    kv.free(sid)
                else:
                    kv.commit(sid, toks, len(toks))
                    live[sid] = toks
            elif op < 0.8 and live:
                sid = rng.choice(sorted(live))
                if kv.is_swapped(sid):
                    if kv.swap_in(sid, len(live[sid])) is None:
                        continue
                toks = live[sid] + [rng.randrange(4)]
                if kv.allocate(sid, len(toks)) is None:
                    if not kv.swap_out(sid, len(live[sid])):
                        kv.free(sid)
                        del live[sid]
                    continue
                kv.commit(sid, toks, len(toks))
                kv.release_outside_window(sid, len(toks))
                live[sid] = toks
            elif live:
                sid = rng.choice(sorted(live))
                kv.free(sid)
                del live[sid]
            kv.flush_copies(lambda d2h, h2d: None)
            kv.check_integrity()
        for sid in list(live):
            kv.free(sid)
        kv.check_integrity()
        assert kv.num_free_blocks == 30


def test_speculative_rollback_and_int8_pool(tmp_path):
    """n-gram drafts are rolled back in every group (greedy output unchanged by speculating);
    an int8 pool works per group too."""
    path = make_hybrid_qwen2(tmp_path / "loopy", WINDOW, seed=2, initializer_range=0.05)
    prompts = [([5, 9, 33] * 5)[:13], list(range(40, 40 + WINDOW + 3))]
    params = SamplingParams(temperature=0, max_tokens=2 * WINDOW, ignore_eos=True)
    exact = _run_checked(_llm(path), prompts, params)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1, "disable_by_batch_size": None}
    spec = _llm(path, speculative_config=ngram)
    assert _run_checked(spec, prompts, params) == exact
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    int8 = _llm(path, kv_cache_dtype="int8")
    got = _run_checked(int8, prompts, params)
    assert int8.stats()["num_blocks_released_window"] > 0
    same = sum(a == b for g, e in zip(got, exact) for a, b in zip(g, e))
    assert same >= 0.8 * sum(len(e) for e in exact)


def test_kv_calc_and_stats_count_per_group(qwen2):
    from engine.models.arch import shape_from_hf_config
    from loadgen.kv_calc import format_report, kv_report, report_dict

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    config = {"model_type": "qwen2", "num_hidden_layers": 18, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
              "sliding_window": 512, "use_sliding_window": True, "layer_types": types}
    report = kv_report(shape_from_hf_config(config, "gemma3-270m-like"), 8192, 1, "bfloat16")
    groups = report_dict(report)["kv_groups"]
    assert len(groups["groups"]) == 6 and groups["layers_per_group"] == 3
    assert groups["bytes_total"] <= 0.3 * report.total  # the memory target
    assert "hybrid KV cache: 6 groups of 3 layers" in format_report(report)
    path, _ = qwen2
    stats = _llm(path).engine.stats()
    assert stats.kv_cache_groups == 2 and stats.kv_cache_group_bytes_per_token > 0
    assert stats.kv_cache_max_concurrency > 0


def test_admission_counts_blocks_per_group():
    from engine.scheduling.admission import AdmissionLimits, _check_fits_pool

    layout = plan_kv_groups((None, WINDOW, WINDOW, None))  # 1 full + 1 window group
    # 40 tokens: 10 full blocks + 3 window blocks (window 8 + one being filled) = 13.
    assert layout.blocks_for(40, BS) == 13
    limits = AdmissionLimits(max_model_len=64, token_id_bound=256, block_size=BS,
                             num_blocks=13, swap_blocks=0, kv_layout=layout)
    _check_fits_pool(limits, 20, 20, 1)
    with pytest.raises(ValueError, match="whole pool holds 40"):
        _check_fits_pool(limits, 20, 21, 1)
    with pytest.raises(ValueError, match="samples need 26 KV blocks"):
        _check_fits_pool(limits, 20, 20, 2)


def _draft(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "disable_by_batch_size": None}


@pytest.mark.parametrize("draft", ["itself", "other-weights"])
def test_a_hybrid_draft_model_keeps_greedy_exact_and_its_window_groups_flat(qwen2, tmp_path,
                                                                          draft):
    """A draft whose layers mix window and full attention (Gemma 3 270M drafting for a larger
    Gemma 3): one table per KV group in the draft's own pool, its window groups giving back
    the blocks behind the window as it catches up, never one a rollback reaches. The target as
    its own draft: every draft accepted; another hybrid model of the same vocabulary: often
    rejected, rolled back in every group. Either way the output is HF's greedy."""
    path, hf = qwen2
    other = path if draft == "itself" else make_hybrid_qwen2(tmp_path / "draft", WINDOW,
                                                                  seed=5)
    prompts = [list(range(20, 20 + 3 * WINDOW)), [7, 8, 9] * 3]
    new = 4 * WINDOW
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm = _llm(path, speculative_config=_draft(other))
    proposer = llm.engine.scheduler.proposer
    assert isinstance(proposer.kv, HybridKVCacheManager)
    peak: list[int] = []
    core = llm.engine
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    done = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        core.kv.check_integrity()
        proposer.kv.check_integrity()
        for seq_id in list(proposer._fed):
            tables = proposer.kv.group_tables(seq_id)
            peak += [sum(b >= 0 for b in t) for t, w in zip(tables, proposer.kv.windows) if w]
    assert [done[f"r{i}"] for i in range(len(prompts))] == [hf_greedy(hf, p, new)
                                                             for p in prompts]
    s = llm.stats()
    assert s["spec_decode_num_drafts"] > 0
    if draft == "itself":
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    else:
        assert s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    # once caught up, a window group holds its window, the block being filled and the
    # lookahead's: flat while the sequences grow to 3 windows and more (a whole prompt's
    # catch-up holds it all until the next propose)
    assert max(peak[len(peak) // 2:]) <= -(-WINDOW // BS) + 1 + -(-3 // BS) + 1 < max(peak)
    assert proposer.kv.num_window_released > 0
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks  # draft state released
