"""The remote tier's counters (cumulative since start-up unless a gauge)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RemoteTierStats:
    """All zero when the tier is off (``kv_remote_url`` unset). Blocks are records: one per
    block of tokens, one per KV group and block with a hybrid KV cache."""

    enabled: bool = False
    available: bool = False  # gauge: in use (False while down: retrying with backoff)
    known_blocks: int = 0  # gauge: blocks this server knows the store holds (wrote or found)
    lookups: int = 0  # look-up round trips (pipelined EXISTS over a prompt's chain)
    hit_blocks: int = 0  # records read back and verified
    miss_blocks: int = 0  # blocks a look-up or read asked for that the store did not hold
    read_bytes: int = 0
    read_seconds: float = 0.0
    written_blocks: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    dropped_writes: int = 0  # queue full or the store down: the block was not written
    bad_records: int = 0  # failed the checksum or the fingerprint: never used, deleted
    errors: int = 0  # failed commands (refused, timed out, protocol errors) and pings
    outages: int = 0  # times the store went down (one WARNING each)
