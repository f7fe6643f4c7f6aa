"""``EngineCore.stats()``: the ``EngineStats`` read from the core's parts (scheduler, KV
manager, runner, tiers, counters, constrained decoding). Engine thread only."""

from __future__ import annotations

import dataclasses

from engine.kv_cache.disk.stats import DiskTierStats
from engine.kv_cache.remote.stats import RemoteTierStats
from engine.kv_events.stats import KVEventsStats
from engine.stats import EngineStats, HostTierStats, LoRAStats
from engine.structured.stats import StructuredStats


def _structured_stats(core) -> StructuredStats:
    stats = dataclasses.replace(core.structured.stats(),
                                restricted_rows=core.counters["restricted_logit_rows"])
    jf = core.jump_forward
    if jf is None:
        return stats
    return dataclasses.replace(stats, jump_forward_drafted=jf.drafted,
                               jump_forward_accepted=jf.accepted)


def _lora_stats(core) -> LoRAStats:
    adapters = core.adapters
    if adapters is None:
        return LoRAStats()
    sched = core.scheduler

    def names(seqs) -> tuple[str, ...]:
        return tuple(sorted({s.request.params.lora_name for s in seqs
                             if s.request.params.lora_name is not None}))

    waiting = [*sched.waiting, *(s for parked in sched.parked_seqs() for s in parked)]
    return LoRAStats(adapters.slots.max_loras, len(adapters.names), names(sched.running),
                     names(waiting), adapters.slots.num_loads)


def engine_stats(core) -> EngineStats:
    """The typed counters the server reads (``EngineCore.stats``), from the core's parts."""
    kv = core.kv.stats()
    return EngineStats(
        num_requests_running=len({s.request.request_id for s in core.scheduler.running}),
        num_requests_waiting=core.scheduler.num_waiting_requests,
        num_seqs_waiting=core.scheduler.num_waiting_seqs,
        kv_cache_usage_perc=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=core.scheduler.num_preemptions,
        num_preemptions_swap=core.scheduler.num_preemptions_swap,
        num_preemptions_recompute=core.scheduler.num_preemptions_recompute,
        prompt_tokens=core.counters["prompt_tokens"],
        generation_tokens=core.counters["generation_tokens"],
        num_steps=core.counters["num_steps"],
        num_blocks_total=kv.num_blocks,
        num_blocks_free=kv.num_free_blocks,
        num_blocks_used=kv.num_used_blocks,
        num_blocks_cached=kv.num_cached_blocks,
        kv_bytes_per_token=core.runner.kv_bytes_per_token,
        kv_cache_groups=core.runner.kv_layout.num_groups,
        kv_cache_group_bytes_per_token=core.runner.kv_page_bytes_per_token,
        kv_cache_max_concurrency=core.runner.kv_layout.max_concurrency(
            kv.num_blocks, core.config.block_size, core.max_model_len),
        num_blocks_released_window=core.kv.num_window_released,
        num_blocks_evicted_stream=core.stream.num_evicted_blocks if core.stream else 0,
        computed_tokens=core.counters["computed_tokens"],
        spec_decode=core.spec_counters.snapshot(),
        structured=_structured_stats(core),
        lora=_lora_stats(core),
        kv_events=(core.kv_events.stats() if core.kv_events is not None
                   else KVEventsStats()),
        host=HostTierStats.from_offload(
            core.kv.offload_stats(), core._block_bytes),
        disk=core.disk.snapshot() if core.disk is not None else DiskTierStats(),
        remote=(core.disk.remote_snapshot() if core.disk is not None else None)
        or RemoteTierStats(),
    )
