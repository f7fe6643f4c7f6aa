"""KV cache events for cache-aware routers (vLLM's ``--kv-events-config`` and schema): the
event types, the engine-thread recorder the KV cache's hooks feed, the ZMQ
publisher (its own thread, a bounded queue, a replay socket) and the wiring into the core.
docs/kv-cache.md ("KV cache events") describes what a subscriber sees."""

from engine.kv_events.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    GroupSpec,
)
from engine.kv_events.recorder import KVEventRecorder, TierHook
from engine.kv_events.stats import KVEventsStats

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_REMOTE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "GroupSpec",
    "KVEventRecorder",
    "KVEventsStats",
    "TierHook",
]
