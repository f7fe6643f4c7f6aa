"""The device block pool: block metadata, the free queue and the hash -> block map.

Every block is in exactly one state: in use (``ref_count > 0``, not in the free queue, may hold
a hash); free-cached (``ref_count == 0``, holds a hash, in the free queue in LRU order; a prefix
hit can take it back out of the middle); free-uncached (no hash, in the free queue ahead of
every free-cached block, so fresh allocations consume them before evicting anything).

Free blocks keep their hash until they are handed out again ("lazy eviction"): only then is the
hash dropped from the map and, if set, ``on_evict(block_id, block_hash)`` called so that an
offload tier may copy the block's KV out before its new owner overwrites it.

The pool knows nothing of sequences; :class:`engine.kv_cache.manager.KVCacheManager` keeps the
block tables and decides what to register."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.kv_cache.hashing import BlockHash

EvictCallback = Callable[[int, BlockHash], None]


@dataclass(slots=True, eq=False)
class KVBlock:
    """Metadata of one physical block. Identity-compared; links are owned by FreeBlockQueue."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append, appendleft and remove-from-middle.

    The head is evicted first. Blocks are linked through their own ``prev``/``next`` fields, so
    membership costs nothing and a block can be in at most one queue.
    """

    def __init__(self, blocks: list[KVBlock] | None = None) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks or ():
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        """Insert at the tail (evicted last)."""
        self._insert_after(self._tail.prev, block)

    def appendleft(self, block: KVBlock) -> None:
        """Insert at the head (handed out first)."""
        self._insert_after(self._head, block)

    def popleft(self) -> KVBlock:
        """Remove and return the head. Raises IndexError when empty."""
        block = self._head.next
        if block is self._tail:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` wherever it is. Raises ValueError if it is not queued."""
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail. O(n): for checks and tests, not for the per-step path."""
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def _insert_after(self, anchor: KVBlock | None, block: KVBlock) -> None:
        if block.prev is not None or block.next is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        assert anchor is not None and anchor.next is not None
        block.prev = anchor
        block.next = anchor.next
        anchor.next.prev = block
        anchor.next = block
        self._len += 1


class BlockPool:
    """All blocks of the device pool, the free queue and the map of registered hashes.

    Invariants (checked by :meth:`check_integrity`): a block is in the free queue iff its
    ``ref_count`` is 0; ``cached[h] is b`` iff ``b.block_hash == h``; every free-uncached block
    precedes every free-cached block in the queue.
    """

    def __init__(self, num_blocks: int, on_evict: EvictCallback | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Lowest ids first, so a fresh pool hands out 0, 1, 2, ... (predictable in tests).
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.on_evict = on_evict
        self.num_free_cached_blocks = 0  # kept up to date so stats stay O(1)
        self.num_evictions = 0  # cached blocks handed out for other KV, cumulative
        # KV cache events (engine.kv_events.TierHook; None: off): told of every hash the pool
        # gains (``stored``) or loses (``removed``), but in a reset (the manager announces that).
        self.events = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks from the head of the free queue with ``ref_count`` 1.

        Free-uncached blocks go first, then free-cached ones in LRU order; a cached block loses
        its hash here (``on_evict`` is called before the block is returned). Raises ValueError if
        fewer than ``n`` blocks are free: callers check :attr:`num_free_blocks` first.
        """
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks but only {len(self.free_queue)} are free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._drop_hash(block, notify=True)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, block: KVBlock) -> None:
        """Take one more reference; a free block (cached hit) leaves the free queue."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self.num_free_cached_blocks -= 1
        block.ref_count += 1

    def free(self, block: KVBlock) -> None:
        """Drop one reference. At zero the block becomes free: cached blocks join the tail (most
        recently used), uncached ones the head (reused before any cached block is evicted)."""
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} freed more often than it was taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)
                self.num_free_cached_blocks += 1

    def register(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Record that ``block`` holds the KV named by ``block_hash``.

        Returns False and changes nothing if the block already holds a hash or the hash is
        already held by another block (the first holder keeps it; the other stays private).
        """
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if block.ref_count == 0:  # registering a free block: keep the queue order invariant
            self.free_queue.remove(block)
            self.free_queue.append(block)
            self.num_free_cached_blocks += 1
        if self.events is not None:
            self.events.stored(block_hash)
        return True

    def unregister(self, block: KVBlock) -> None:
        """Forget ``block``'s hash (no ``on_evict``: its KV is about to be overwritten, not
        displaced), for a block in use whose content stops being what the hash names. No-op
        for a block without a hash. Raises ValueError for a free block (free blocks lose their
        hash only when handed out)."""
        if block.block_hash is None:
            return
        if block.ref_count == 0:
            raise ValueError(f"block {block.block_id} is free: its hash goes when it is reused")
        self._drop_hash(block, notify=False)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def evict_cached_free_blocks(self) -> int:
        """Drop the hash of every free-cached block (no ``on_evict``: the KV is being discarded,
        not displaced). Returns how many were dropped. In-use blocks keep theirs."""
        dropped = [b for b in self.free_queue if b.block_hash is not None]
        for block in dropped:
            self._drop_hash(block, notify=False, announce=False)
            # Uncached blocks belong ahead of cached ones.
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        return len(dropped)

    def _drop_hash(self, block: KVBlock, notify: bool, announce: bool = True) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        del self.cached[block_hash]
        block.block_hash = None
        if block.ref_count == 0:
            self.num_free_cached_blocks -= 1
        if notify:
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block.block_id, block_hash)
        if announce and self.events is not None:  # after on_evict: a spill is stored first
            self.events.removed(block_hash)

    def check_integrity(self) -> None:
        """Assert the pool's own invariants (O(num_blocks)); see the class docstring."""
        queued = list(self.free_queue)
        assert len(queued) == len(self.free_queue), (
            f"free queue length {len(self.free_queue)} but {len(queued)} linked blocks"
        )
        seen_cached = False
        for block in queued:
            assert block.ref_count == 0, (
                f"block {block.block_id} is in the free queue with ref_count {block.ref_count}"
            )
            if block.block_hash is not None:
                seen_cached = True
            else:
                assert not seen_cached, (
                    f"free-uncached block {block.block_id} sits behind a free-cached block"
                )
        num_free_cached = sum(b.block_hash is not None for b in queued)
        assert num_free_cached == self.num_free_cached_blocks, (
            f"{num_free_cached} free-cached blocks but the counter says {self.num_free_cached_blocks}"
        )
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued), "a block appears twice in the free queue"
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            if block.ref_count == 0:
                assert block.block_id in queued_ids, (
                    f"block {block.block_id} has ref_count 0 but is not in the free queue"
                )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"block {block.block_id} holds a hash the map does not point to it"
                )
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, (
                f"hash map points to block {block.block_id}, which holds another hash"
            )
            assert self.blocks[block.block_id] is block, "hash map points to a foreign block"
        assert (
            len(self.free_queue) + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks
        ), "free + used != total"
