"""The disk tier's options, frozen and validated (``ValueError`` with an actionable message)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(value: int | float | str) -> int:
    """Bytes from ``4GiB``, ``500MB``, ``1e9`` or an int. ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be a number of bytes or like 20GiB; got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read the size {value!r}: give bytes or a number with a "
                             f"unit such as 512MiB, 20GiB or 1TB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ValueError(f"a size cannot be negative; got {value!r}")
    return n


WRITE_POLICIES = ("write-through", "on-evict")


@dataclass(frozen=True)
class DiskTierConfig:
    """``directory``: where the segments live (created if missing; one that cannot be used
    leaves the tier down and retried, never the server stopped: ``health``).
    ``size_bytes``: the most bytes the directory holds, every fingerprint's files together
    (LRU eviction, other fingerprints first: ``budget``).
    ``segment_bytes``: a segment file is closed and a new one started past this size.
    ``queue_blocks``: blocks the writer may have queued; more are dropped, never waited for.
    ``write_policy``: ``write-through`` writes the blocks a request has just committed (a crash
    loses at most the queue); ``on-evict`` writes a block when it leaves host memory, and the
    blocks still cached in memory at a clean shutdown (fewer bytes written; a crash loses
    what memory held).
    """

    directory: str
    size_bytes: int
    segment_bytes: int = 4 * 1024**2
    queue_blocks: int = 256
    write_policy: str = "write-through"

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("kv_disk_dir is empty: give a directory for the disk KV tier")
        if self.segment_bytes < 4096:
            raise ValueError(f"kv disk segments must be >= 4096 bytes; got {self.segment_bytes}")
        if self.size_bytes < 2 * self.segment_bytes:
            raise ValueError(f"kv_disk_size {self.size_bytes} bytes is below two segments "
                             f"({2 * self.segment_bytes} bytes); give more, "
                             f"e.g. --kv-disk-size 20GiB")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv_disk_write_policy must be one of {', '.join(WRITE_POLICIES)}; "
                             f"got {self.write_policy!r}")
        if self.queue_blocks < 1:
            raise ValueError(f"the disk writer queue needs >= 1 block; got {self.queue_blocks}")

    @classmethod
    def for_size(cls, directory: str, size_bytes: int,
                 write_policy: str = "write-through") -> DiskTierConfig:
        """Segments of 4 MiB, smaller for a tier under 32 MiB (a tier holds >= 8)."""
        seg = min(4 * 1024**2, max(4096, size_bytes // 8))
        return cls(directory, size_bytes, segment_bytes=seg, write_policy=write_policy)
