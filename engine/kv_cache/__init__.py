"""Paged KV cache bookkeeping: block pool, chained block hashes, per-sequence block tables
(``KVCacheManager``, owned by the scheduler; ``HybridKVCacheManager`` with one table per KV
group for models mixing sliding-window and full layers), and the host tier (``HostTier``: spill,
load-back, swap) that the manager holds as a component."""

from engine.kv_cache.block_pool import BlockPool, EvictCallback, FreeBlockQueue, KVBlock
from engine.kv_cache.groups import KVCacheGroupSpec, KVGroupLayout, plan_kv_groups
from engine.kv_cache.hashing import (
    ROOT_PARENT,
    BlockHash,
    compute_block_hashes,
    encode_extra_keys,
    hash_block,
)
from engine.kv_cache.host.blocks import BlockCopies, HostKVCache, OffloadStats, SwapCostModel
from engine.kv_cache.host.tier import HostTier
from engine.kv_cache.hybrid import HybridKVCacheManager, HybridPrefixHit
from engine.kv_cache.manager import KVCacheManager, KVCacheStats, PrefixHit

__all__ = [
    "ROOT_PARENT",
    "BlockCopies",
    "BlockHash",
    "BlockPool",
    "EvictCallback",
    "FreeBlockQueue",
    "HostKVCache",
    "HostTier",
    "HybridKVCacheManager",
    "HybridPrefixHit",
    "KVBlock",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheStats",
    "KVGroupLayout",
    "OffloadStats",
    "PrefixHit",
    "SwapCostModel",
    "compute_block_hashes",
    "encode_extra_keys",
    "hash_block",
    "plan_kv_groups",
]
