"""ChainStore: the disk store then the remote store behind the one interface ``DiskTier``
drives (``engine.kv_cache.disk.tier``), or the remote store alone when there is no disk tier.

* Look-ups and reads go disk first, then remote for what follows (the tier itself looks at
  device and host memory before): ``lookup`` is the disk's leading run plus the remote's run
  after it; ``read_many`` reads the disk's blocks one by one and the rest with one ``MGET``.
* Writes go to each store that lacks the block (``submit``); ``stored_everywhere`` tells the
  tier whether a block still needs writing anywhere, ``in`` whether it can be read.
* ``config``, ``stats``, ``health``, ``dir``, ``snapshot`` are the disk store's (the tier's
  own counters, hits and misses, land in the disk's stats: with both stores they count blocks
  loaded from below the host tier, the remote's included); ``remote_snapshot`` is the remote
  store's. With the remote store alone ``snapshot`` is the disk tier's all-zero stats.
"""

from __future__ import annotations

from engine.kv_cache.disk.stats import DiskTierStats
from engine.kv_cache.disk.store import DiskStore
from engine.kv_cache.remote.stats import RemoteTierStats
from engine.kv_cache.remote.store import RemoteStore


class ChainStore:
    def __init__(self, disk: DiskStore | None, remote: RemoteStore) -> None:
        if disk is not None and disk.block_bytes != remote.block_bytes:
            raise ValueError(f"disk blocks of {disk.block_bytes} bytes, remote blocks of "
                             f"{remote.block_bytes}")
        self.disk = disk
        self.remote = remote
        self.block_bytes = remote.block_bytes
        self.config = disk.config if disk is not None else remote.config
        # the tier's own counters (DiskTier mutates them); not reported without a disk
        self.stats = disk.stats if disk is not None else DiskTierStats()
        self.health = disk.health if disk is not None else remote.health
        self.dir = disk.dir if disk is not None else remote.where
        self.tier_name = "disk" if disk is not None else "remote"

    def __contains__(self, block_hash: bytes) -> bool:
        return (self.disk is not None and block_hash in self.disk) or block_hash in self.remote

    def __len__(self) -> int:
        return len(self.disk) if self.disk is not None else len(self.remote)

    def stored_everywhere(self, block_hash: bytes) -> bool:
        """Every store holds ``block_hash`` (as far as this server knows): nothing to write."""
        return (self.disk is None or block_hash in self.disk) and block_hash in self.remote

    @property
    def writable(self) -> bool:
        return (self.disk is not None and self.disk.writable) or self.remote.writable

    def lookup(self, hashes) -> int:
        hashes = list(hashes)
        n = self.disk.lookup(hashes) if self.disk is not None else 0
        return n + (self.remote.lookup(hashes[n:]) if n < len(hashes) else 0)

    def probe(self, hashes) -> None:
        """Learn which of ``hashes`` the remote store holds (``RemoteStore.probe``)."""
        self.remote.probe([h for h in hashes if not (self.disk is not None and h in self.disk)])

    def refresh(self, force: bool = False) -> bool:
        return self.disk.refresh(force) if self.disk is not None else False

    def read(self, block_hash: bytes) -> bytes | None:
        return self.read_many([block_hash])[0]

    def read_many(self, hashes: list[bytes]) -> list[bytes | None]:
        """Payloads in order, None where neither store has a good copy."""
        out: list[bytes | None] = []
        disk = self.disk
        while disk is not None and len(out) < len(hashes) and hashes[len(out)] in disk:
            payload = disk.read(hashes[len(out)])
            if payload is None:  # bad or gone: the remote store may have it
                break
            out.append(payload)
        return out + self.remote.read_many(hashes[len(out):])

    def submit(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue the block for each store that lacks it; True if any took it."""
        queued = False
        if self.disk is not None and block_hash not in self.disk:
            queued = self.disk.submit(block_hash, payload)
        if block_hash not in self.remote:
            queued = self.remote.submit(block_hash, payload) or queued
        return queued

    def flush(self, timeout: float = 30.0) -> None:
        if self.disk is not None:
            self.disk.flush(timeout)
        self.remote.flush(timeout)

    def close(self) -> None:
        try:
            if self.disk is not None:
                self.disk.close()
        finally:
            self.remote.close()

    def snapshot(self) -> DiskTierStats:
        return self.disk.snapshot() if self.disk is not None else DiskTierStats()

    def remote_snapshot(self) -> RemoteTierStats:
        return self.remote.snapshot()

    def describe_remote(self) -> str:
        return self.remote.describe()
