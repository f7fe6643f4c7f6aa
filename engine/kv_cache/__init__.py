"""Paged KV cache bookkeeping: block pool, chained block hashes, per-sequence block tables."""

from engine.kv_cache.block_pool import BlockPool, EvictCallback, FreeBlockQueue, KVBlock
from engine.kv_cache.hashing import (
    ROOT_PARENT,
    BlockHash,
    compute_block_hashes,
    encode_extra_keys,
    hash_block,
)
from engine.kv_cache.manager import KVCacheManager, KVCacheStats, PrefixHit

__all__ = [
    "ROOT_PARENT",
    "BlockHash",
    "BlockPool",
    "EvictCallback",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVCacheStats",
    "PrefixHit",
    "compute_block_hashes",
    "encode_extra_keys",
    "hash_block",
]
