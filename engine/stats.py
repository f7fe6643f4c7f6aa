"""``EngineStats``: the engine's counters and gauges as one typed snapshot.

``EngineCore.stats()`` builds it after each step; ``AsyncEngine.stats()`` hands the latest one to
the server (``server/metrics.py`` reads its attributes, so a misspelt field fails loudly instead
of dropping a metric); ``LLM.stats()`` flattens it with :meth:`EngineStats.as_dict` into the
string keys of the public offline API. Snapshots are frozen: a reader on another thread never
sees one half-updated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv_cache.disk.stats import DiskTierStats
from engine.kv_cache.remote.stats import RemoteTierStats
from engine.kv_events.stats import KVEventsStats
from engine.spec_decode.stats import SpecDecodeStats
from engine.structured.stats import StructuredStats

if TYPE_CHECKING:
    from engine.kv_cache.host.blocks import OffloadStats


@dataclass(frozen=True)
class HostTierStats:
    """The host (CPU memory) KV tier; all zero when ``swap_space`` is 0. Block and token
    counts are cumulative since start-up except the ``host_blocks_*`` gauges."""

    offload_blocks_d2h: int = 0
    offload_blocks_h2d: int = 0
    offload_bytes_d2h: int = 0
    offload_bytes_h2d: int = 0
    host_blocks_total: int = 0
    host_blocks_used: int = 0
    host_blocks_cached: int = 0
    host_kv_usage_perc: float = 0.0
    host_evictions: int = 0
    offload_spills: int = 0
    prefix_cache_host_hits: int = 0  # prompt tokens loaded back instead of computed
    num_swapped_seqs: int = 0

    @classmethod
    def from_offload(cls, s: OffloadStats | None, block_bytes: int) -> HostTierStats:
        """From the tier's own counters (None: the tier is off, everything zero)."""
        if s is None:
            return cls()
        return cls(
            offload_blocks_d2h=s.blocks_d2h,
            offload_blocks_h2d=s.blocks_h2d,
            offload_bytes_d2h=s.blocks_d2h * block_bytes,
            offload_bytes_h2d=s.blocks_h2d * block_bytes,
            host_blocks_total=s.num_host_blocks,
            host_blocks_used=s.host_blocks_used,
            host_blocks_cached=s.host_blocks_cached,
            host_kv_usage_perc=s.host_usage,
            host_evictions=s.host_evictions,
            offload_spills=s.spills,
            prefix_cache_host_hits=s.host_prefix_hit_tokens,
            num_swapped_seqs=s.num_swapped_seqs,
        )


@dataclass(frozen=True)
class LoRAStats:
    """LoRA adapters (engine.adapters): slots, and the adapters of the running and the waiting
    requests by name (vLLM's ``vllm:lora_requests_info``); zeros when LoRA is off."""

    max_loras: int = 0  # 0: LoRA off
    loaded: int = 0
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    slot_loads: int = 0  # adapters placed into a device slot, cumulative


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of the engine. Gauges describe the moment; token, step, preemption and
    prefix-cache counts are cumulative since start-up (prefix-cache queries/hits in tokens)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_seqs_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    num_blocks_used: int = 0
    num_blocks_cached: int = 0
    kv_bytes_per_token: int = 0
    # KV groups (engine.kv_cache.groups): 1 unless the model mixes sliding-window and full
    # layers; each group's bytes per token (all equal); sequences of max_model_len the pool holds.
    kv_cache_groups: int = 1
    kv_cache_group_bytes_per_token: int = 0
    kv_cache_max_concurrency: float = 0.0
    num_blocks_released_window: int = 0  # given back outside a sliding window, cumulative
    num_blocks_evicted_stream: int = 0  # evicted by --kv-eviction (sinks + window), cumulative
    computed_tokens: int = 0
    host: HostTierStats = field(default_factory=HostTierStats)
    disk: DiskTierStats = field(default_factory=DiskTierStats)
    remote: RemoteTierStats = field(default_factory=RemoteTierStats)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    structured: StructuredStats = field(default_factory=StructuredStats)
    kv_events: KVEventsStats = field(default_factory=KVEventsStats)
    lora: LoRAStats = field(default_factory=LoRAStats)

    def replace(self, **changes: object) -> EngineStats:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, int | float]:
        """Flat ``{name: value}``, the host tier's fields beside the others (``LLM.stats()``);
        speculative decoding's as ``spec_decode_num_drafts`` .. and one
        ``spec_decode_num_accepted_tokens_pos<j>`` per draft position."""
        out: dict[str, int | float] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in ("host", "disk", "remote", "spec_decode", "structured",
                              "kv_events", "lora")}
        out.update(dataclasses.asdict(self.host))
        out.update(lora_loaded=self.lora.loaded, lora_slot_loads=self.lora.slot_loads)
        out.update({f"kv_events_{k}": v for k, v in dataclasses.asdict(self.kv_events).items()})
        out.update({f"disk_{k}": v for k, v in dataclasses.asdict(self.disk).items()})
        out.update({f"remote_{k}": v for k, v in dataclasses.asdict(self.remote).items()})
        sd = self.spec_decode
        out.update(spec_decode_num_drafts=sd.num_drafts,
                   spec_decode_num_draft_tokens=sd.num_draft_tokens,
                   spec_decode_num_accepted_tokens=sd.num_accepted_tokens)
        for j, n in enumerate(sd.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_pos{j}"] = n
        st = self.structured
        out.update(structured_compiles=st.compiles,
                   structured_compile_failures=st.compile_failures,
                   structured_cache_hits=st.cache_hits,
                   structured_compile_seconds_sum=st.compile_seconds_sum,
                   structured_constrained_rows=st.constrained_rows,
                   structured_jump_forward_drafted=st.jump_forward_drafted,
                   structured_jump_forward_accepted=st.jump_forward_accepted,
                   structured_restricted_rows=st.restricted_rows)
        return out
