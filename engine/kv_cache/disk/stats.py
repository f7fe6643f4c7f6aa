"""The disk tier's counters (cumulative since start-up unless a gauge)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DiskTierStats:
    """All zero when the tier is off (``kv_disk_dir`` unset)."""

    enabled: bool = False
    capacity_bytes: int = 0  # --kv-disk-size
    used_bytes: int = 0  # gauge: bytes of the directory (every fingerprint's, every server's)
    blocks: int = 0  # gauge: blocks this server's index can find
    blocks_at_start: int = 0
    hit_blocks: int = 0  # blocks read back and verified
    miss_blocks: int = 0  # lookups of a prompt's next block that the disk did not hold
    hit_tokens: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    written_blocks: int = 0
    dropped_writes: int = 0  # queue full or the tier down: the block was not written
    checksum_failures: int = 0  # bad records found by a read (a miss; dropped from the index)
    evicted_blocks: int = 0  # this fingerprint's, evicted to keep the directory's size
    disk_full: bool = False  # gauge: down because the disk is full (cleared on recovery)
    prefetched_blocks: int = 0  # disk blocks loaded into host memory ahead of admission
    available: bool = False  # gauge: writing (False while down: retrying with backoff)
    write_errors: int = 0  # failed writes, directory opens and retries
    evicted_foreign_segments: int = 0  # other fingerprints' segments evicted for the size
    pruned_files: int = 0  # orphaned files removed at start (engine.kv_cache.disk.budget)
