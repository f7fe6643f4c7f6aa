"""Truncating a sequence's block table: the KV side of speculative decoding's rollback.

A verification step writes K/V for every drafted token; those of rejected drafts must never be
read or shared. So: drafts never enter a sequence's token ids unless accepted, and ``commit``
registers only full blocks within the computed tokens (no hash names rejected K/V, so spills and
swaps never move it); ``truncate_table`` returns blocks wholly past the kept length to the pool
(uncached, reused first), and a kept block the cut falls inside stops being a cache entry
(``BlockPool.unregister``), the cut refused if another table shares it.

Rejected K/V left in the last kept block's slots past the cut is harmless: attention reads keys
``0 .. seq_len - 1`` only, and a slot is rewritten by the step that computes its position before
any step reads it."""

from __future__ import annotations

from collections.abc import Callable

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import BlockHash


def truncate_table(pool: BlockPool, block_ids: list[int], hashes: list[BlockHash],
                   num_committed: int, num_tokens: int, block_size: int,
                   on_free: Callable[[int], None] | None = None) -> int:
    """Cut ``block_ids`` (in place) to the ``ceil(num_tokens / block_size)`` blocks holding
    ``num_tokens`` tokens; trim ``hashes`` (in place) to the blocks still full. Returns the new
    committed count (``min(num_committed, full blocks)``).

    Dropped blocks lose one reference each, the table's tail first (as ``free`` does).
    Raises ValueError, changing nothing, when ``num_tokens`` is negative or the cut would make a
    shared block partial. ``on_free`` sees each dropped block id (tests).
    """
    if num_tokens < 0:
        raise ValueError(f"cannot truncate to {num_tokens} tokens")
    keep = -(-num_tokens // block_size)
    full = num_tokens // block_size
    blocks = pool.blocks
    partial = blocks[block_ids[keep - 1]] if full < keep <= len(block_ids) else None
    if partial is not None and partial.ref_count > 1:
        raise ValueError(f"cannot truncate to {num_tokens} tokens: block {partial.block_id} "
                         f"would become partial but is shared by {partial.ref_count} tables")
    dropped = block_ids[keep:]
    del block_ids[keep:]
    for block_id in reversed(dropped):
        pool.free(blocks[block_id])
        if on_free is not None:
            on_free(block_id)
    if partial is not None:
        pool.unregister(partial)  # its tail will be rewritten: it no longer names that KV
    del hashes[full:]
    return min(num_committed, full)
