"""EngineStats: the typed engine/server seam. Its flat form keeps the keys of ``LLM.stats()``,
and every gauge and counter of ``/metrics`` reads a field that exists."""

from __future__ import annotations

import dataclasses

from engine.kv_cache.disk.stats import DiskTierStats
from engine.kv_cache.remote.stats import RemoteTierStats
from engine.kv_events.stats import KVEventsStats
from engine.spec_decode.stats import SpecDecodeStats
from engine.stats import EngineStats, HostTierStats, LoRAStats
from server.metrics import ServerMetrics

LEGACY_KEYS = {
    "num_requests_running", "num_requests_waiting", "num_seqs_waiting", "kv_cache_usage_perc",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_preemptions_swap",
    "num_preemptions_recompute", "prompt_tokens", "generation_tokens", "num_steps",
    "num_blocks_total", "num_blocks_free", "num_blocks_used", "num_blocks_cached",
    "kv_bytes_per_token", "computed_tokens", "offload_blocks_d2h", "offload_blocks_h2d",
    "offload_bytes_d2h", "offload_bytes_h2d", "host_blocks_total", "host_blocks_used",
    "host_blocks_cached", "host_kv_usage_perc", "host_evictions", "offload_spills",
    "prefix_cache_host_hits", "num_swapped_seqs"}
SPEC_KEYS = {"spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens"}


KV_GROUP_KEYS = {"kv_cache_groups", "kv_cache_group_bytes_per_token", "kv_cache_max_concurrency"}
JUMP_FORWARD_KEYS = {"structured_jump_forward_drafted", "structured_jump_forward_accepted"}
DISK_KEYS = {f"disk_{f.name}" for f in dataclasses.fields(DiskTierStats)}
REMOTE_KEYS = {f"remote_{f.name}" for f in dataclasses.fields(RemoteTierStats)}
KV_EVENTS_KEYS = {f"kv_events_{f.name}" for f in dataclasses.fields(KVEventsStats)}
LORA_KEYS = {"lora_loaded", "lora_slot_loads"}
STRUCTURED_KEYS = {"structured_compiles", "structured_compile_failures", "structured_cache_hits",
                   "structured_compile_seconds_sum", "structured_constrained_rows",
                   "structured_restricted_rows"}


def test_flat_form_keeps_the_offline_api_keys():
    stats = EngineStats(num_blocks_used=3, host=HostTierStats(offload_spills=2))
    flat = stats.as_dict()
    assert LEGACY_KEYS <= set(flat)  # kept; new counters may join
    assert set(flat) - LEGACY_KEYS == {"num_blocks_released_window",
                                       "num_blocks_evicted_stream"} | SPEC_KEYS | STRUCTURED_KEYS \
        | KV_GROUP_KEYS | JUMP_FORWARD_KEYS | DISK_KEYS | REMOTE_KEYS | KV_EVENTS_KEYS | LORA_KEYS
    per_pos = EngineStats(spec_decode=SpecDecodeStats(2, 8, 3, (2, 1, 0, 0))).as_dict()
    assert per_pos["spec_decode_num_accepted_tokens_pos1"] == 1
    assert set(per_pos) - set(flat) == {f"spec_decode_num_accepted_tokens_pos{j}"
                                        for j in range(4)}
    assert flat["num_blocks_used"] == 3 and flat["offload_spills"] == 2
    assert stats.replace(num_requests_waiting=5).num_requests_waiting == 5
    assert dataclasses.is_dataclass(stats)


def test_every_metric_reads_a_real_field():
    host = HostTierStats(**{f.name: i + 1 for i, f in enumerate(dataclasses.fields(HostTierStats))})
    stats = EngineStats(**{f.name: i + 1 for i, f in enumerate(dataclasses.fields(EngineStats))
                           if f.name not in ("host", "disk", "remote", "spec_decode",
                                             "structured", "kv_events", "lora")},
                        host=host, spec_decode=SpecDecodeStats(4, 16, 7, (3, 2, 1, 1)),
                        disk=DiskTierStats(**{f.name: i + 1 for i, f in
                                              enumerate(dataclasses.fields(DiskTierStats))}),
                        remote=RemoteTierStats(**{f.name: i + 1 for i, f in
                                                  enumerate(dataclasses.fields(RemoteTierStats))}),
                        kv_events=KVEventsStats(**{f.name: i + 1 for i, f in
                                                   enumerate(dataclasses.fields(KVEventsStats))}),
                        lora=LoRAStats(4, 3, ("sql",), ("chat", "fr"), 5))
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert ('kvserve:lora_requests_info{max_lora="4",running_lora_adapters="sql",'
            'waiting_lora_adapters="chat,fr"}') in text
    assert 'kvserve:kv_cache_used_blocks{model_name="m"} 15.0' in text
    assert 'kvserve:kv_offload_spills_total{model_name="m"} 10.0' in text
    assert 'kvserve:num_preemptions_by_mode_total{mode="swap",model_name="m"} 8.0' in text
    assert 'kvserve:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'kvserve:prefix_cache_disk_hits_total{model_name="m"} 8.0' in text
    assert 'kvserve:disk_kv_cache_blocks_total{model_name="m",result="miss"} 7.0' in text
    assert 'kvserve:local_storage_usage{model_name="m"} 3.0' in text
    assert 'kvserve:remote_kv_cache_blocks_total{model_name="m",result="hit"} 5.0' in text
    assert 'kvserve:remote_kv_cache_dropped_writes_total{model_name="m"} 12.0' in text
    assert 'kvserve:structured_output_constrained_rows_total{model_name="m"} 0.0' in text
    assert 'kvserve:structured_output_compile_seconds_count{model_name="m"} 0.0' in text
    assert 'kvserve:spec_decode_num_draft_tokens_total{model_name="m"} 16.0' in text
    assert 'kvserve:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert ('kvserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}'
            ' 2.0') in text
