"""TieredKVCacheManager: the device KVCacheManager with a host tier under it.

Three movements, all recorded while the scheduler runs and executed by :meth:`flush_copies`
once per step before the model runs (one batched call per direction, device->host first):

- spill: a free-cached device block that is reused (``BlockPool.on_evict``) is written back
  to the host under its hash, unless the host already holds that hash;
- load-back: ``find_prefix`` continues a device hit with blocks the host holds; ``allocate``
  gives them fresh device blocks, registers their hashes there at once and copies them in;
- swap: ``swap_out`` moves a preempted sequence's computed blocks to the host (named blocks
  the host already holds are shared, not copied) and frees its device blocks; ``swap_in`` gives
  it device blocks again (named blocks still on the device are shared, not copied).

A sequence is either live (``_seqs``: a device table), swapped (``_swapped``: a host table), or
unknown; ``free`` ends it in either state and releases everything exactly once. Host references
are held by swapped sequences and by pins of the step's pending copies, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_cache.block_pool import EvictCallback, KVBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.manager import KVCacheManager, PrefixHit, _SeqState
from engine.kv_cache.offload import BlockCopies, HostKVCache, OffloadStats, SwapCostModel

CopyFn = Callable[[list[tuple[int, int]], list[tuple[int, int]]], None]


@dataclass
class _Swapped:
    state: _SeqState  # hashes and commit progress survive; the device table is empty
    host_blocks: list[KVBlock]  # one reference each, held by this sequence
    names: list[BlockHash | None]  # the hash each block's KV is known under (None: unnamed)
    num_tokens: int  # tokens whose KV the host blocks hold


def _device_part(prefix: PrefixHit | None, block_size: int) -> PrefixHit | None:
    if prefix is None or not prefix.host_hashes:
        return prefix
    n = len(prefix.block_ids)
    return PrefixHit(prefix.block_ids, n * block_size, prefix.block_hashes)


class TieredKVCacheManager(KVCacheManager):
    """KVCacheManager plus a host pool of ``num_host_blocks`` blocks (see the module docstring).

    ``cost`` drives :meth:`swap_is_cheaper` (``preemption_mode="auto"``); without one, swapping
    counts as free. Every base-class contract holds; ``check_integrity`` adds the host pool.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int,
                 enable_prefix_caching: bool = True, on_evict: EvictCallback | None = None,
                 cost: SwapCostModel | None = None) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_host_blocks}; "
                             "raise swap_space or set it to 0 to turn the tier off")
        self.host = HostKVCache(num_host_blocks)
        self._user_on_evict = on_evict
        super().__init__(num_blocks, block_size, enable_prefix_caching, on_evict=self._spill)
        self.cost = cost or SwapCostModel(seconds_per_token=1.0, seconds_per_block=0.0)
        self._swapped: dict[str, _Swapped] = {}
        self._host_hit_tokens = 0

    def _spill(self, block_id: int, block_hash: BlockHash) -> None:
        self.host.spill(block_id, block_hash)
        if self._user_on_evict is not None:
            self._user_on_evict(block_id, block_hash)

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def _check_live(self, seq_id: str) -> None:
        if seq_id in self._swapped:
            raise ValueError(f"{seq_id} is swapped out: swap_in before anything else")

    # ---- prefix lookup and load-back ---------------------------------------------------
    def find_prefix(self, seq_id: str, token_ids: Sequence[int], extra_keys: tuple = (), *,
                    record_stats: bool = True) -> PrefixHit:
        """The device hit, continued by blocks the host holds (``PrefixHit.host_hashes``)."""
        self._check_live(seq_id)
        hit = super().find_prefix(seq_id, token_ids, extra_keys, record_stats=False)
        if self.enable_prefix_caching:
            max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
            host_hashes = []
            for h in self._seqs[seq_id].hashes[len(hit.block_ids):max_blocks]:
                if self.host.lookup(h) is None:
                    break
                host_hashes.append(h)
            if host_hashes:
                hit = PrefixHit(hit.block_ids, hit.num_tokens + len(host_hashes) * self.block_size,
                                hit.block_hashes, tuple(host_hashes))
        if record_stats:
            self.record_prefix_stats(len(token_ids), hit.num_tokens)
        return hit

    def num_blocks_needed(self, seq_id: str, num_tokens: int,
                          prefix: PrefixHit | None = None) -> int:
        # Host blocks of the hit need fresh device blocks: they count among the fresh ones.
        return super().num_blocks_needed(seq_id, num_tokens, _device_part(prefix, self.block_size))

    def allocate(self, seq_id: str, num_tokens: int,
                 prefix: PrefixHit | None = None) -> list[int] | None:
        """As the base class; a hit's host blocks get the first fresh device blocks, their
        hashes at once, and a host->device copy each (counted as host prefix hits)."""
        self._check_live(seq_id)
        if prefix is None or not prefix.host_hashes:
            return super().allocate(seq_id, num_tokens, prefix)
        bs = self.block_size
        if prefix.num_tokens != prefix.num_blocks * bs or num_tokens < prefix.num_tokens:
            raise ValueError(f"a prefix of {prefix.num_blocks} blocks must cover "
                             f"{prefix.num_blocks * bs} tokens and lie within num_tokens")
        if self.block_table(seq_id):
            raise ValueError("a prefix can only start a block table: the sequence already "
                             "has blocks")
        host_blocks = [self.host.lookup(h) for h in prefix.host_hashes]
        if any(b is None for b in host_blocks):
            raise ValueError("stale prefix hit: a host block was evicted since find_prefix; "
                             "call find_prefix again right before allocate")
        device = _device_part(prefix, bs)
        if not self.can_allocate(seq_id, num_tokens, device):
            return None
        for hb in host_blocks:  # before allocating: spills must not evict them
            self.host.pin(hb)
        new_ids = super().allocate(seq_id, num_tokens, device)
        assert new_ids is not None and len(new_ids) >= len(host_blocks)
        for hb, h, dev in zip(host_blocks, prefix.host_hashes, new_ids):
            self.host.record_h2d(hb, dev)
            self.pool.register(self.pool.blocks[dev], h)  # may stay a private duplicate
        self._host_hit_tokens += len(host_blocks) * bs
        return new_ids

    # ---- swap --------------------------------------------------------------------------
    def _names(self, state: _SeqState, num_tokens: int) -> tuple[list[KVBlock], list]:
        n = -(-num_tokens // self.block_size)
        if n > len(state.block_ids):
            raise ValueError(f"{num_tokens} tokens but a table of {len(state.block_ids)} blocks")
        blocks = [self.pool.blocks[b] for b in state.block_ids[:n]]
        named = min(state.num_committed, len(state.hashes), num_tokens // self.block_size)
        names = [b.block_hash if b.block_hash is not None else
                 (state.hashes[i] if i < named else None) for i, b in enumerate(blocks)]
        return blocks, names

    def _host_copies_for(self, blocks: list[KVBlock], names: list) -> list[KVBlock | None]:
        """For each block, a host block that already holds (or will hold) its KV, or None.
        A block still waiting for its load keeps its source's name (``names`` is updated)."""
        out: list[KVBlock | None] = []
        for i, (block, name) in enumerate(zip(blocks, names)):
            held = self.host.pending_source(block.block_id)  # its KV has not arrived yet
            if held is not None:
                names[i] = held.block_hash  # the host block's own name (if any) is the truth
            elif name is not None:
                held = self.host.lookup(name)
            out.append(held)
        return out

    def swap_cost_blocks(self, seq_id: str, num_tokens: int) -> tuple[int, int]:
        """(blocks to copy out, blocks to copy back in) if ``seq_id`` were swapped now."""
        state = self._seqs.get(seq_id)
        if state is None:
            return 0, 0
        blocks, names = self._names(state, num_tokens)
        held = self._host_copies_for(blocks, names)
        return sum(1 for h in held if h is None), len(blocks)

    def swap_is_cheaper(self, seq_id: str, num_tokens: int) -> bool:
        """Whether swapping ``seq_id`` (``num_tokens`` computed) beats recomputing them."""
        out, back = self.swap_cost_blocks(seq_id, num_tokens)
        return self.cost.swap_is_cheaper(num_tokens, out, back)

    def swap_out(self, seq_id: str, num_tokens: int) -> bool:
        """Move the KV of ``seq_id``'s first ``num_tokens`` tokens to the host and free all its
        device blocks. Returns False and changes nothing when the sequence is not live, has
        nothing computed, or the host cannot make room (the caller recomputes instead)."""
        state = self._seqs.get(seq_id)
        if state is None or num_tokens <= 0:
            return False
        blocks, names = self._names(state, num_tokens)
        held = self._host_copies_for(blocks, names)
        host_pool = self.host.pool
        need = sum(1 for h in held if h is None or h.ref_count == 0)
        if need > host_pool.num_free_blocks:
            return False
        for h in held:  # first: the allocations below must not evict them
            if h is not None:
                host_pool.touch(h)
        host_blocks = []
        for block, name, h in zip(blocks, names, held):
            if h is None:
                h = self.host.new_pinned_block()
                host_pool.touch(h)  # the sequence's reference; the pin covers the copy
                if name is not None:
                    registered = host_pool.register(h, name)
                    assert registered, "a named block the host lacked is now held twice"
                self.host.record_d2h(block.block_id, h)
            host_blocks.append(h)
        self._swapped[seq_id] = _Swapped(state, host_blocks, names, num_tokens)
        super().free(seq_id)
        state.block_ids = []
        return True

    def swap_in(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Give swapped ``seq_id`` a device table covering ``num_tokens`` tokens (at least the
        swapped ones). Returns the table, or None with nothing changed if the device pool is
        short. Named blocks still on the device are shared; the rest are copied back."""
        sw = self._swapped.get(seq_id)
        if sw is None:
            raise ValueError(f"{seq_id} is not swapped out")
        if num_tokens < sw.num_tokens:
            raise ValueError(f"swap_in must cover the {sw.num_tokens} swapped tokens")
        pool = self.pool
        on_device = [pool.lookup(h) if h is not None else None for h in sw.names]
        extra = max(0, -(-num_tokens // self.block_size) - len(sw.host_blocks))
        fresh = sum(1 for d in on_device if d is None) + extra
        if fresh + sum(1 for d in on_device if d is not None and d.ref_count == 0) \
                > pool.num_free_blocks:
            return None
        for d in on_device:
            if d is not None:
                pool.touch(d)
        new = iter(pool.get_new_blocks(fresh))  # spills may follow; our host blocks are held
        table = []
        for hb, name, d in zip(sw.host_blocks, sw.names, on_device):
            if d is None:
                d = next(new)
                self.host.record_h2d(hb, d.block_id)
                self.host.adopt_pin(hb)  # the source stays until the copy has run
                if name is not None:
                    pool.register(d, name)
            else:
                self.host.pool.free(hb)
            table.append(d.block_id)
        table.extend(b.block_id for b in new)
        sw.state.block_ids = table
        del self._swapped[seq_id]
        self._seqs[seq_id] = sw.state
        return list(table)

    # ---- release, copies, reset --------------------------------------------------------
    def free(self, seq_id: str) -> None:
        """End ``seq_id`` whether live or swapped (idempotent). A swapped sequence's host
        blocks are released; named ones stay in the host prefix cache."""
        sw = self._swapped.pop(seq_id, None)
        if sw is not None:
            for hb in reversed(sw.host_blocks):
                self.host.pool.free(hb)
        super().free(seq_id)

    def flush_copies(self, copy_fn: CopyFn) -> BlockCopies:
        """Run this step's copies through ``copy_fn(d2h, h2d)`` (device->host first), then
        release their pins. Call once per step, after scheduling and before the model runs."""
        copies = self.host.take_copies()
        try:
            if copies:
                copy_fn(copies.d2h, copies.h2d)
        finally:
            self.host.finish_copies()
        return copies

    def reset_prefix_cache(self) -> bool:
        """Drop the hash of every free block in both tiers (nothing is written back)."""
        device_empty = super().reset_prefix_cache()
        self.host.reset()
        return device_empty and not self.host.pool.cached

    # ---- stats and checks --------------------------------------------------------------
    def offload_stats(self) -> OffloadStats:
        return self.host.stats(self._host_hit_tokens, len(self._swapped))

    def check_integrity(self) -> None:
        """The base invariants, the host pool's, and: swapped sequences are not live, hold one
        reference per host block, and their named blocks hold those names; every pending load
        whose device block is named comes from the host block holding that name."""
        super().check_integrity()
        bs = self.block_size
        holders: dict[int, int] = {}
        for seq_id, sw in self._swapped.items():
            assert seq_id not in self._seqs, f"{seq_id} is both live and swapped"
            assert not sw.state.block_ids, f"swapped {seq_id} still has a device table"
            assert len(sw.host_blocks) == len(sw.names) == -(-sw.num_tokens // bs), (
                f"swapped {seq_id}: {len(sw.host_blocks)} host blocks for {sw.num_tokens} tokens")
            for hb, name in zip(sw.host_blocks, sw.names):
                holders[hb.block_id] = holders.get(hb.block_id, 0) + 1
                if name is not None:
                    assert hb.block_hash == name, (
                        f"swapped {seq_id}: host block {hb.block_id} lost its hash")
        self.host.check_integrity(holders)
        if not self.enable_prefix_caching:
            assert not self.host.pool.cached, "prefix caching is disabled but host blocks hold hashes"
        for hb_id, dev in self.host.pending.h2d:
            name = self.pool.blocks[dev].block_hash
            if name is not None:
                assert self.host.lookup(name) is self.host.pool.blocks[hb_id], (
                    f"device block {dev} is named but its pending load is not that name's block")
