"""HostTier: the host KV tier, a component the device ``KVCacheManager`` holds.

Its interface has the shape of vLLM's offloading manager, in block hashes and block ids (it
knows nothing of a sequence's device table, tokens or hashes in progress): ``lookup(hashes)``,
``prepare_load`` / ``load`` (a prefix hit's load-back into fresh device blocks),
``prepare_store`` (the spill of an evicted device block, wired to ``BlockPool.on_evict``),
``take_copies`` / ``complete_copies`` (``flush_copies`` does both around a copy function), and
``swap_out`` / ``swap_in`` of a preempted sequence (blocks the other side already holds are
shared, not copied).

All copies are recorded while the scheduler runs and executed once per step before the model
runs, device->host first (:mod:`engine.kv_cache.host.blocks` says why that order is safe). Host
references are held by swapped sequences and by pins of the step's pending copies, nothing else."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.host.blocks import BlockCopies, HostKVCache, OffloadStats, SwapCostModel

CopyFn = Callable[[list[tuple[int, int]], list[tuple[int, int]]], None]


@dataclass
class _HostTable:
    host_blocks: list[KVBlock]  # one reference each, held by the swapped sequence
    names: list[BlockHash | None]  # the hash each block's KV is known under (None: unnamed)
    num_tokens: int  # tokens whose KV the host blocks hold


class HostTier:
    """``num_host_blocks`` host blocks under the device ``device_pool`` (module docstring).

    ``cost`` drives :meth:`swap_is_cheaper` (``preemption_mode="auto"``); without one, swapping
    counts as free.
    """

    def __init__(self, num_host_blocks: int, device_pool: BlockPool, block_size: int,
                 cost: SwapCostModel | None = None) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_host_blocks}; "
                             "raise swap_space or set it to 0 to turn the tier off")
        self.cache = HostKVCache(num_host_blocks)
        self.device_pool = device_pool
        self.block_size = block_size
        self.cost = cost or SwapCostModel(seconds_per_token=1.0, seconds_per_block=0.0)
        self._swapped: dict[str, _HostTable] = {}
        self._hit_tokens = 0
        # Host block id -> references held outside this class (the disk tier's reads in
        # flight), for check_integrity.
        self.external_holders: Callable[[], dict[int, int]] | None = None

    # ---- views -------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        """The host blocks' states (the host prefix cache is ``pool.cached``)."""
        return self.cache.pool

    @property
    def pending(self) -> BlockCopies:
        """The copies recorded since the last :meth:`complete_copies` (read-only view)."""
        return self.cache.pending

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    # ---- look up, load, store ----------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` the host holds. Changes nothing."""
        n = 0
        for h in hashes:
            if self.cache.lookup(h) is None:
                break
            n += 1
        return n

    def prepare_load(self, hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """Pin the host blocks named ``hashes`` (all held: ``lookup(hashes) == len(hashes)``,
        else ValueError) so that no spill evicts them before their copies ran."""
        blocks = [self.cache.lookup(h) for h in hashes]
        if any(b is None for b in blocks):
            raise ValueError("stale prefix hit: a host block was evicted since find_prefix; "
                             "call find_prefix again right before allocate")
        for hb in blocks:
            self.cache.pin(hb)
        return blocks

    def load(self, host_blocks: Sequence[KVBlock], device_blocks: Sequence[int],
             hit_tokens: int | None = None) -> None:
        """Order the copy of each pinned host block into its device block; counted as
        ``hit_tokens`` host prefix hits (default: the blocks' tokens; a hybrid cache's groups
        load pages of the same tokens and count them once)."""
        for hb, dev in zip(host_blocks, device_blocks, strict=True):
            self.cache.record_h2d(hb, dev)
        self._hit_tokens += (len(host_blocks) * self.block_size if hit_tokens is None
                             else hit_tokens)

    def prepare_store(self, device_block: int, block_hash: BlockHash) -> None:
        """Keep the KV of an evicted device block about to be reused (see
        ``HostKVCache.spill``)."""
        self.cache.spill(device_block, block_hash)

    def take_copies(self) -> BlockCopies:
        """Hand out the copies recorded so far; their pins stay until :meth:`complete_copies`."""
        return self.cache.take_copies()

    def complete_copies(self) -> None:
        """The copies handed out by :meth:`take_copies` have run: release their pins."""
        self.cache.finish_copies()

    def flush_copies(self, copy_fn: CopyFn) -> BlockCopies:
        """Run the recorded copies through ``copy_fn(d2h, h2d)``, then release their pins."""
        copies = self.take_copies()
        try:
            if copies:
                copy_fn(copies.d2h, copies.h2d)
        finally:
            self.complete_copies()
        return copies

    # ---- swap --------------------------------------------------------------------------
    def _host_copies_for(self, blocks: list[KVBlock], names: list) -> list[KVBlock | None]:
        """For each device block, a host block that already holds (or will hold) its KV, or
        None. A block still waiting for its load keeps its source's name (``names`` is
        updated)."""
        out: list[KVBlock | None] = []
        for i, (block, name) in enumerate(zip(blocks, names)):
            held = self.cache.pending_source(block.block_id)  # its KV has not arrived yet
            if held is not None:
                names[i] = held.block_hash  # the host block's own name (if any) is the truth
            elif name is not None:
                held = self.cache.lookup(name)
            out.append(held)
        return out

    def swap_cost_blocks(self, blocks: list[KVBlock], names: list) -> tuple[int, int]:
        """(blocks to copy out, blocks to copy back in) to swap device ``blocks`` now."""
        held = self._host_copies_for(blocks, list(names))
        return sum(1 for h in held if h is None), len(blocks)

    def swap_is_cheaper(self, num_tokens: int, blocks: list[KVBlock], names: list) -> bool:
        """Whether swapping ``blocks`` (holding ``num_tokens`` computed tokens) beats
        recomputing them."""
        out, back = self.swap_cost_blocks(blocks, names)
        return self.cost.swap_is_cheaper(num_tokens, out, back)

    def swap_out(self, seq_id: str, blocks: list[KVBlock], names: list,
                 num_tokens: int) -> bool:
        """Keep the KV of device ``blocks`` (``names[i]``: the hash block ``i`` is known
        under, or None) as ``seq_id``'s host table. Returns False and changes nothing when the
        host cannot make room. The caller then frees the device blocks (copies read them first)."""
        names = list(names)
        held = self._host_copies_for(blocks, names)
        host_pool = self.cache.pool
        need = sum(1 for h in held if h is None or h.ref_count == 0)
        if need > host_pool.num_free_blocks:
            return False
        for h in held:  # first: the allocations below must not evict them
            if h is not None:
                host_pool.touch(h)
        host_blocks = []
        for block, name, h in zip(blocks, names, held):
            if h is None:
                h = self.cache.new_pinned_block()
                host_pool.touch(h)  # the sequence's reference; the pin covers the copy
                if name is not None:
                    registered = host_pool.register(h, name)
                    assert registered, "a named block the host lacked is now held twice"
                self.cache.record_d2h(block.block_id, h)
            host_blocks.append(h)
        self._swapped[seq_id] = _HostTable(host_blocks, names, num_tokens)
        return True

    def swap_in(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Device block ids (from the device pool, one reference each) covering ``num_tokens``
        tokens (at least the swapped ones) for swapped ``seq_id``, which stops being swapped.
        None with nothing changed if the device pool is short. Named blocks still on the device
        are shared; the rest are copied back."""
        sw = self._swapped.get(seq_id)
        if sw is None:
            raise ValueError(f"{seq_id} is not swapped out")
        if num_tokens < sw.num_tokens:
            raise ValueError(f"swap_in must cover the {sw.num_tokens} swapped tokens")
        pool = self.device_pool
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
                self.cache.record_h2d(hb, d.block_id)
                self.cache.adopt_pin(hb)  # the source stays until the copy has run
                if name is not None:
                    pool.register(d, name)
            else:
                self.cache.pool.free(hb)
            table.append(d.block_id)
        table.extend(b.block_id for b in new)
        del self._swapped[seq_id]
        return table

    def free(self, seq_id: str) -> None:
        """Release swapped ``seq_id``'s host blocks (no-op otherwise); named ones stay in the
        host prefix cache."""
        sw = self._swapped.pop(seq_id, None)
        if sw is not None:
            for hb in reversed(sw.host_blocks):
                self.cache.pool.free(hb)

    def reset(self) -> None:
        """Forget every free host-cached block (nothing is written back)."""
        self.cache.reset()

    # ---- stats and checks --------------------------------------------------------------
    def stats(self) -> OffloadStats:
        return self.cache.stats(self._hit_tokens, len(self._swapped))

    def swapped_ids(self) -> set[str]:
        return set(self._swapped)

    def check_integrity(self, enable_prefix_caching: bool) -> None:
        """The host pool's invariants and: swapped sequences hold one reference per host
        block and their named blocks hold those names; every pending load whose device block
        is named comes from the host block holding that name."""
        bs = self.block_size
        holders: dict[int, int] = {}
        for seq_id, sw in self._swapped.items():
            assert len(sw.host_blocks) == len(sw.names) == -(-sw.num_tokens // bs), (
                f"swapped {seq_id}: {len(sw.host_blocks)} host blocks for {sw.num_tokens} tokens")
            for hb, name in zip(sw.host_blocks, sw.names):
                holders[hb.block_id] = holders.get(hb.block_id, 0) + 1
                if name is not None:
                    assert hb.block_hash == name, (
                        f"swapped {seq_id}: host block {hb.block_id} lost its hash")
        if self.external_holders is not None:
            for hb_id, n in self.external_holders().items():
                holders[hb_id] = holders.get(hb_id, 0) + n
        self.cache.check_integrity(holders)
        if not enable_prefix_caching:
            assert not self.cache.pool.cached, \
                "prefix caching is disabled but host blocks hold hashes"
        for hb_id, dev in self.cache.pending.h2d:
            name = self.device_pool.blocks[dev].block_hash
            if name is not None:
                assert self.cache.lookup(name) is self.cache.pool.blocks[hb_id], (
                    f"device block {dev} is named but its pending load is not that name's block")
