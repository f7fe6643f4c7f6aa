"""``kvserve bench profile`` and ``bench utilisation`` on a tiny random model (fast): the time
shares are a partition of the step time, the measured KV growth is the formula's rounded up to
whole blocks, and paged blocks hold a larger share of live tokens than per-request
pre-allocation at max_model_len."""

from __future__ import annotations

import argparse

import pytest

from engine.loading.tiny import make_tiny_model_dir
from loadgen import profile, utilisation


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("kvbench") / "tiny",
                                   max_position_embeddings=256))


def test_profile_table(tiny, monkeypatch):
    monkeypatch.setenv("KVSERVE_DECODE_STACK", "0")
    args = argparse.Namespace(model=tiny, num_requests=2, input_len=20, output_len=6,
                              dtype="float32", kv_cache_memory="2MiB", trace_dir=None, json=None)
    result = profile.run(args)
    for phase in ("prefill", "decode"):
        shares = result[phase]["shares"]
        assert result[phase]["steps"] >= 1
        assert all(v >= 0 for v in shares.values())
        assert sum(shares[p] for p in profile.PARTS) <= 1.0 + 1e-9
        assert shares["linear"] > 0 and shares["attention"] > 0
    assert result["decode"]["shares"]["sampling"] > 0
    growth = result["kv_growth"]
    assert growth[-1]["live_tokens"] > growth[0]["live_tokens"]
    bs = 16  # the engine's default block size
    per_token = growth[0]["formula_bytes"] // growth[0]["live_tokens"]
    for g in growth:
        # every sequence's KV rounded up to whole blocks: at most one partial block each
        assert g["formula_bytes"] <= g["measured_bytes"]
        assert g["measured_bytes"] - g["formula_bytes"] < 2 * bs * per_token
    assert "attention" in profile.format_table(result)


def test_utilisation_paged_beats_contiguous(tiny):
    from engine.llm import LLM

    llm = LLM(tiny, dtype="float32", kv_cache_memory="2MiB", max_num_seqs=4,
              enable_prefix_caching=False)
    spec = {"num_requests": 4, "input": (5, 40), "output": (2, 12)}
    p = utilisation.measure(llm.engine, "mixed", spec, seed=0)
    llm.close()
    assert p["steps"] > 0
    assert 0 < p["contiguous"] < p["paged"] <= 1.0
