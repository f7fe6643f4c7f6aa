"""``KVEvents``: the recorder and the publisher, attached to the engine's KV cache.

``attach`` (the core calls it once the KV manager and the disk tier exist, when the config is
active) gives the device pool, the host tier's pool and the disk tier their hooks; the core
then calls ``flush`` at the end of every step and ``close`` at shutdown. A reset of the prefix
cache flushes at once (it happens between steps, through the engine thread).
"""

from __future__ import annotations

from engine.config.kv_events import KVEventsConfig
from engine.kv_cache.groups import KVGroupLayout
from engine.kv_events.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_REMOTE,
    GroupSpec,
)
from engine.kv_events.recorder import KVEventRecorder
from engine.kv_events.stats import KVEventsStats

# vllm-router refuses a batch of more than 4096 events: a larger step goes out in parts.
MAX_EVENTS_PER_BATCH = 4096


class KVEvents:
    """``publisher``: anything with ``publish(events) -> bool``, ``stats()`` and ``close()``
    (``ZmqEventPublisher``; tests pass their own)."""

    def __init__(self, recorder: KVEventRecorder, publisher) -> None:
        self.recorder = recorder
        self.publisher = publisher
        recorder.on_clear = self.flush

    def flush(self) -> None:
        """Publish the events recorded since the last flush (engine thread; never blocks)."""
        events = self.recorder.take()
        for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
            self.publisher.publish(events[i:i + MAX_EVENTS_PER_BATCH])

    def stats(self) -> KVEventsStats:
        return self.publisher.stats()

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def group_specs(layout: KVGroupLayout | None) -> tuple[GroupSpec, ...] | None:
    """Per group of a hybrid cache what its events carry; None for one group."""
    if layout is None or not layout.is_hybrid:
        return None
    return tuple(GroupSpec(g, w) for g, w in enumerate(layout.windows))


def attach(kv, disk=None, layout: KVGroupLayout | None = None, *, publisher=None,
           config: KVEventsConfig | None = None) -> KVEvents:
    """Hook ``kv`` (a ``KVCacheManager`` or ``HybridKVCacheManager``), its host tier and
    ``disk`` (a ``DiskTier`` or None) to a new recorder publishing through ``publisher`` (by
    default a ``ZmqEventPublisher`` for ``config``)."""
    if publisher is None:
        from engine.kv_events.publisher import ZmqEventPublisher

        publisher = ZmqEventPublisher(config or KVEventsConfig(enable_kv_cache_events=True))
    recorder = KVEventRecorder(kv.block_size, group_specs(layout))
    kv.pool.events = recorder.tier(MEDIUM_GPU, kv.pool.cached)
    if kv.host is not None:
        kv.host.pool.events = recorder.tier(MEDIUM_CPU, kv.host.pool.cached)
    if disk is not None:  # a remote store alone (engine.kv_cache.remote) has no disk part
        remote_only = getattr(disk.store, "disk", disk.store) is None
        disk.events = recorder.tier(MEDIUM_REMOTE if remote_only else MEDIUM_DISK)
    return KVEvents(recorder, publisher)
