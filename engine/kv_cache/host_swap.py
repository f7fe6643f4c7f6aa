"""The KV manager's host-tier side (``KVCacheManager`` mixes it in; ``self.host`` is the
``engine.kv_cache.host.tier.HostTier`` or None).

With a host tier the manager continues a device prefix hit with blocks the host holds
(``PrefixHit.host_hashes``, loaded back by ``allocate``: ``_allocate_with_load``), spills
evicted cached blocks to the host (``_spill``), and swaps preempted sequences out and in
(``swap_out``, ``swap_in``). A swapped sequence's host table lives in the tier; its hashes and
commit progress stay in ``self._swapped``. The copies all of that needs are recorded, not
run: ``take_copies`` hands them out once per step and ``complete_copies`` releases their pins.
Without a host tier every method here is a no-op or refuses.
"""

from __future__ import annotations

from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.host.blocks import BlockCopies, OffloadStats, SwapCostModel
from engine.kv_cache.host.tier import CopyFn
from engine.kv_cache.tables import RELEASED, PrefixHit, _SeqState


class HostSwap:
    """Spills, load-backs and swaps of a ``KVCacheManager`` (which provides ``host``, ``pool``,
    ``block_size``, ``_seqs``, ``_swapped``, ``_free_device`` and ``allocate``)."""

    def _spill(self, block_id: int, block_hash: BlockHash) -> None:
        self.host.prepare_store(block_id, block_hash)
        if self._user_on_evict is not None:
            self._user_on_evict(block_id, block_hash)

    def _allocate_with_load(self, seq_id: str, num_tokens: int,
                            prefix: PrefixHit) -> list[int] | None:
        bs = self.block_size
        if prefix.num_tokens != prefix.num_blocks * bs or num_tokens < prefix.num_tokens:
            raise ValueError(f"a prefix of {prefix.num_blocks} blocks must cover "
                             f"{prefix.num_blocks * bs} tokens and lie within num_tokens")
        if self.block_table(seq_id):
            raise ValueError("a prefix can only start a block table: the sequence already "
                             "has blocks")
        if self.host.lookup(prefix.host_hashes) != len(prefix.host_hashes):
            raise ValueError("stale prefix hit: a host block was evicted since find_prefix; "
                             "call find_prefix again right before allocate")
        device = self._device_part(prefix)
        if not self.can_allocate(seq_id, num_tokens, device):
            return None
        host_blocks = self.host.prepare_load(prefix.host_hashes)  # spills must not evict them
        new_ids = self.allocate(seq_id, num_tokens, device)
        assert new_ids is not None and len(new_ids) >= len(host_blocks)
        loaded = new_ids[:len(host_blocks)]
        self.host.load(host_blocks, loaded)
        for h, dev in zip(prefix.host_hashes, loaded):
            self.pool.register(self.pool.blocks[dev], h)  # may stay a private duplicate
        return new_ids

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    def _swap_names(self, state: _SeqState, num_tokens: int) -> tuple[list[KVBlock], list]:
        """The device blocks holding the first ``num_tokens`` tokens (from the first one not
        released outside a sliding window) and the hash each one's KV is known under (None:
        unnamed)."""
        n = -(-num_tokens // self.block_size)
        if n > len(state.block_ids):
            raise ValueError(f"{num_tokens} tokens but a table of {len(state.block_ids)} blocks")
        r = state.num_released
        blocks = [self.pool.blocks[b] for b in state.block_ids[r:n]]
        named = min(state.num_committed, len(state.hashes), num_tokens // self.block_size)
        names = [b.block_hash if b.block_hash is not None else
                 (state.hashes[i] if i < named else None) for i, b in enumerate(blocks, r)]
        return blocks, names

    def swap_cost_blocks(self, seq_id: str, num_tokens: int) -> tuple[int, int]:
        """(blocks to copy out, blocks to copy back in) if ``seq_id`` were swapped now."""
        state = self._seqs.get(seq_id)
        if state is None or self.host is None:
            return 0, 0
        return self.host.swap_cost_blocks(*self._swap_names(state, num_tokens))

    def swap_is_cheaper(self, seq_id: str, num_tokens: int) -> bool:
        """Whether swapping ``seq_id`` (``num_tokens`` computed) beats recomputing them."""
        out, back = self.swap_cost_blocks(seq_id, num_tokens)
        cost = self.host.cost if self.host is not None else SwapCostModel(1.0, 0.0)
        return cost.swap_is_cheaper(num_tokens, out, back)

    def swap_out(self, seq_id: str, num_tokens: int) -> bool:
        """Move the KV of ``seq_id``'s first ``num_tokens`` tokens to the host and free all its
        device blocks. Returns False and changes nothing when there is no host tier, the
        sequence is not live, has nothing computed, or the host cannot make room (the caller
        recomputes instead)."""
        state = self._seqs.get(seq_id)
        if self.host is None or state is None or num_tokens <= 0:
            return False
        blocks, names = self._swap_names(state, num_tokens)
        # Blocks released outside a sliding window stay released: the host keeps the rest.
        offset = state.num_released * self.block_size
        if not self.host.swap_out(seq_id, blocks, names, num_tokens - offset):
            return False
        self._swapped[seq_id] = state
        self._free_device(seq_id)
        state.block_ids = []
        return True

    def swap_in(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Give swapped ``seq_id`` a device table covering ``num_tokens`` tokens (at least the
        swapped ones). Returns the table, or None with nothing changed if the device pool is
        short. Named blocks still on the device are shared; the rest are copied back."""
        if self.host is None or seq_id not in self._swapped:
            raise ValueError(f"{seq_id} is not swapped out")
        released = self._swapped[seq_id].num_released
        table = self.host.swap_in(seq_id, num_tokens - released * self.block_size)
        if table is None:
            return None
        state = self._swapped.pop(seq_id)
        state.block_ids = [RELEASED] * released + table
        self._seqs[seq_id] = state
        return list(table)

    def take_copies(self) -> BlockCopies:
        """The block copies recorded since the last call (spills, load-backs, swaps); their
        host blocks stay pinned until :meth:`complete_copies`. Empty without a host tier."""
        return self.host.take_copies() if self.host is not None else BlockCopies()

    def complete_copies(self) -> None:
        """The copies handed out by :meth:`take_copies` have run: release their pins."""
        if self.host is not None:
            self.host.complete_copies()

    def flush_copies(self, copy_fn: CopyFn) -> BlockCopies:
        """``take_copies``, run them through ``copy_fn(d2h, h2d)`` (device->host first),
        ``complete_copies``: for callers that run the copies themselves (tests, tools)."""
        if self.host is None:
            return BlockCopies()
        return self.host.flush_copies(copy_fn)

    def offload_stats(self) -> OffloadStats | None:
        """The host tier's counters (None without one)."""
        return self.host.stats() if self.host is not None else None


    def _check_host(self) -> None:
        """``check_integrity``'s host part: the host pool's invariants, and swapped sequences
        are not live and hold no device table."""
        if self.host is None:
            return
        for seq_id, state in self._swapped.items():
            assert seq_id not in self._seqs, f"{seq_id} is both live and swapped"
            assert not state.block_ids, f"swapped {seq_id} still has a device table"
        assert set(self._swapped) == self.host.swapped_ids(), "swapped sequences out of sync"
        self.host.check_integrity(self.enable_prefix_caching)
