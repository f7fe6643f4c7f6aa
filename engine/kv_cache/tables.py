"""The KV manager's plain data: a sequence's block-table record, the placeholder of a block
given back outside a sliding window, a prefix hit, the pool's stats (``engine.kv_cache.manager``
re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache.hashing import BlockHash

RELEASED = -1  # a table entry whose block went back to the pool (outside the sliding window)


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks covering the first ``num_tokens`` tokens of a sequence.

    ``block_hashes`` (optional, same length as ``block_ids``) lets ``allocate`` verify the blocks
    still hold that KV: a hit found by :meth:`KVCacheManager.find_prefix` carries them. A prefix
    built by hand from a sibling's table (``PrefixHit(table[:k], k * block_size)``) leaves them
    empty; its blocks must then be in use or free-cached.

    ``host_hashes`` names the blocks right after ``block_ids`` that only the host tier holds
    (``allocate`` loads them back); ``num_tokens`` covers both parts. A manager without a host
    tier refuses such a hit.

    ``num_skipped`` (a sliding-window group of the hybrid manager, ``engine.kv_cache.hybrid``):
    the hit starts with that many blocks no future query can see; ``allocate`` enters them as
    :data:`RELEASED` and ``block_ids`` holds the blocks after them. ``num_tokens`` covers all.
    """

    block_ids: list[int]
    num_tokens: int
    block_hashes: tuple[BlockHash, ...] = field(default=(), repr=False)
    host_hashes: tuple[BlockHash, ...] = field(default=(), repr=False)
    num_skipped: int = 0

    @property
    def num_blocks(self) -> int:
        return self.num_skipped + len(self.block_ids) + len(self.host_hashes)


@dataclass
class KVCacheStats:
    """A snapshot of the pool. Prefix counters are in tokens and cumulative since start-up."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # blocks holding a hash, in use or free
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens hit
    usage: float  # used / total
    num_free_cached_blocks: int = 0  # evictable blocks still holding a hash


@dataclass
class _SeqState:
    block_ids: list[int] = field(default_factory=list)
    # Content hashes of the sequence's full blocks, as far as computed (by find_prefix or commit).
    hashes: list[BlockHash] = field(default_factory=list)
    extra_keys: tuple = ()
    extra: bytes = b""
    media: tuple = ()  # the media spans of extra_keys (hashing.split_media), per block
    num_committed: int = 0  # table entries commit() has already dealt with
    num_released: int = 0  # leading table entries given back (RELEASED), sliding window
