"""Speculative decoding through the HTTP server: a server started with a speculative config
serves completions, and ``/metrics`` carries vLLM's spec_decode counters (drafts, draft tokens,
accepted tokens, accepted per position) with the values the engine counted."""

from __future__ import annotations

import httpx

from engine.async_engine import AsyncEngine
from engine.config.engine import EngineConfig
from engine.loading.tiny import make_tiny_model_dir
from server.app import build_app
from tests.server.helpers import ServerThread, sample, scrape


def test_spec_decode_counters_on_metrics(tmp_path):
    model = make_tiny_model_dir(tmp_path / "tiny", seed=2, initializer_range=0.05)
    config = EngineConfig(model=str(model), served_model_name="tiny", dtype="float32",
                          block_size=4, kv_cache_memory="4MiB",
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 3,'
                                             ' "prompt_lookup_min": 1}')
    engine = AsyncEngine(config)
    with ServerThread(build_app(engine)) as srv:
        before = scrape(srv.url)
        assert sample(before, "kvserve:spec_decode_num_drafts_total") == 0
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "abcabcabcabcabc", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 40
        m = scrape(srv.url)
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert sample(m, "kvserve:spec_decode_num_drafts_total") == stats.num_drafts
    assert sample(m, "kvserve:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert sample(m, "kvserve:spec_decode_num_accepted_tokens_total") == \
        stats.num_accepted_tokens
    per_pos = [sample(m, "kvserve:spec_decode_num_accepted_tokens_per_pos_total",
                      position=str(j)) for j in range(3)]
    assert per_pos == list(stats.accepted_per_pos) and per_pos[0] > 0
    assert sum(per_pos) == stats.num_accepted_tokens
