"""Truncating a sequence's block table: the KV side of speculative decoding's rollback.

A verification step writes K/V for every drafted token; those of rejected drafts must never
be read or shared. The rules that make that hold (``truncate_table`` enforces the last two):

* drafts never enter a sequence's token ids unless accepted, and ``commit`` registers only
  full blocks within the computed (accepted) tokens, so no hash ever names rejected K/V, and
  neither spills nor swaps (which follow the hashes and the computed count) move it to the
  host tier;
* blocks wholly past the kept length go back to the pool (uncached: the head of the free
  queue, reused first);
* a kept block that is no longer full (the cut falls inside it) will be written again: if it
  held a hash it stops being a cache entry (``BlockPool.unregister``), and if another table
  shares it the cut is refused (full blocks are shared, never copied on write).

Rejected K/V left in the slots of the last kept block past the cut is harmless: attention
reads keys ``0 .. seq_len - 1`` only, and a slot is rewritten by the step that computes its
position before any step reads it.
"""

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
