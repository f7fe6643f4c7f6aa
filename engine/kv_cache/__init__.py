"""Paged KV cache bookkeeping: block pool, chained block hashes, per-sequence block tables,
and the host tier (spill, load-back, swap) under them."""

from engine.kv_cache.block_pool import BlockPool, EvictCallback, FreeBlockQueue, KVBlock
from engine.kv_cache.hashing import (
    ROOT_PARENT,
    BlockHash,
    compute_block_hashes,
    encode_extra_keys,
    hash_block,
)
from engine.kv_cache.manager import KVCacheManager, KVCacheStats, PrefixHit
from engine.kv_cache.offload import BlockCopies, HostKVCache, OffloadStats, SwapCostModel
from engine.kv_cache.tiered import TieredKVCacheManager

__all__ = [
    "ROOT_PARENT",
    "BlockCopies",
    "BlockHash",
    "BlockPool",
    "EvictCallback",
    "FreeBlockQueue",
    "HostKVCache",
    "KVBlock",
    "KVCacheManager",
    "KVCacheStats",
    "OffloadStats",
    "PrefixHit",
    "SwapCostModel",
    "TieredKVCacheManager",
    "compute_block_hashes",
    "encode_extra_keys",
    "hash_block",
]
