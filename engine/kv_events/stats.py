"""The KV events publisher's counters (cumulative since start-up unless a gauge)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVEventsStats:
    """All zero when KV cache events are off (``--kv-events-config``)."""

    enabled: bool = False
    published_events: int = 0  # events sent on the PUB socket
    published_batches: int = 0  # messages sent (one per engine step that had events)
    dropped_events: int = 0  # events of batches dropped: the publisher's queue was full
    dropped_batches: int = 0
    replays: int = 0  # replay requests answered
    queued_batches: int = 0  # gauge: batches waiting for the publisher thread
