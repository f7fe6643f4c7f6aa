"""HybridKVCacheManager: one block table per KV group and sequence over one shared pool.

For models whose layers mix attention types (``engine.kv_cache.groups``): the scheduler's calls
of :class:`~engine.kv_cache.manager.KVCacheManager`, coordinating one such manager per group over
the same :class:`BlockPool` (and host tier). A full group keeps every block; a sliding-window
group of window ``W`` gives back the blocks that slid out after every step, holding at most
``ceil(W / block_size) + 1`` blocks of a decoding sequence.

Every operation is all-or-nothing across the groups (``allocate``, ``swap_out`` / ``swap_in``
check the summed need first). Group ``g`` keys its records by :func:`group_key` and salts its
block hashes with ``g``, so the groups' cache entries never alias. Prefix hits follow vLLM's
rule: ``k`` blocks need every block ``0 .. k-1`` in a full group and only what a query at
position ``k * block_size`` can see in a window group; the hit is the longest ``k`` every group
accepts. Blocks only the host holds are loaded back by ``allocate``, as in the one-group manager."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, EvictCallback
from engine.kv_cache.groups import KVGroupLayout
from engine.kv_cache.hashing import BlockHash, extend_block_hashes
from engine.kv_cache.host.blocks import BlockCopies, OffloadStats, SwapCostModel
from engine.kv_cache.host.tier import CopyFn, HostTier
from engine.kv_cache.manager import KVCacheManager, KVCacheStats, PrefixHit

ON_HOST = object()  # find_prefix: a block only the host tier holds (or a tier below it)


def _device_then_host(flags: list) -> bool:
    """Whether ``flags`` are device blocks followed by host-only blocks (none missing)."""
    i = 0
    while i < len(flags) and flags[i] is not None and flags[i] is not ON_HOST:
        i += 1
    while i < len(flags) and flags[i] is ON_HOST:
        i += 1
    return i == len(flags)


def group_key(seq_id: str, group: int) -> str:
    """The name group ``group`` files ``seq_id`` under (group 0: the id itself)."""
    return seq_id if group == 0 else f"{seq_id}\x00g{group}"


@dataclass(frozen=True)
class HybridPrefixHit:
    """A prefix hit of ``num_tokens`` tokens: one :class:`PrefixHit` per group."""

    groups: tuple[PrefixHit, ...]
    num_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b for g in self.groups for b in g.block_ids]


class HybridKVCacheManager:
    """The scheduler's KV manager for a hybrid layout (more than one group)."""

    def __init__(self, num_blocks: int, block_size: int, layout: KVGroupLayout,
                 enable_prefix_caching: bool = True, on_evict: EvictCallback | None = None, *,
                 num_host_blocks: int = 0, cost: SwapCostModel | None = None) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._user_on_evict = on_evict
        self.pool = BlockPool(num_blocks, on_evict=self._spill if num_host_blocks else on_evict)
        self.host: HostTier | None = (
            HostTier(num_host_blocks, self.pool, block_size, cost) if num_host_blocks else None)
        self.groups = [
            KVCacheManager(num_blocks, block_size, enable_prefix_caching, pool=self.pool,
                           host=self.host, hash_salt=b"\x00g%d" % g if g else b"",
                           kv_group=g)
            for g in range(layout.num_groups)]
        self.windows = layout.windows
        self._queries = 0
        self._hits = 0

    def _spill(self, block_id: int, block_hash: BlockHash) -> None:
        self.host.prepare_store(block_id, block_hash)
        if self._user_on_evict is not None:
            self._user_on_evict(block_id, block_hash)

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return (self.num_blocks - self.pool.num_free_blocks) / self.num_blocks

    @property
    def num_window_released(self) -> int:
        return sum(m.num_window_released for m in self.groups)

    def block_table(self, seq_id: str) -> list[int]:
        """Group 0's table (``group_tables`` gives every group's)."""
        return self.groups[0].block_table(seq_id)

    def group_tables(self, seq_id: str) -> tuple[list[int], ...]:
        """Copies of ``seq_id``'s table in every group, group order."""
        return tuple(m.block_table(group_key(seq_id, g)) for g, m in enumerate(self.groups))

    def num_committed_blocks(self, seq_id: str) -> int:
        return self.groups[0].num_committed_blocks(seq_id)

    def num_live_blocks(self, seq_id: str) -> int:
        """Blocks ``seq_id`` holds now, all groups."""
        return sum(m.num_live_blocks(group_key(seq_id, g)) for g, m in enumerate(self.groups))

    def is_swapped(self, seq_id: str) -> bool:
        return self.groups[0].is_swapped(seq_id)

    # ------------------------------------------------------------ prefix lookup
    def find_prefix(self, seq_id: str, token_ids: Sequence[int], extra_keys: tuple = (), *,
                    record_stats: bool = True) -> HybridPrefixHit:
        """The longest prefix every group can resume from (module docstring); no references
        taken. Each group's block hashes are computed once and remembered for ``commit``."""
        for g, m in enumerate(self.groups):
            m._check_live(group_key(seq_id, g))
        empty = HybridPrefixHit(tuple(PrefixHit([], 0) for _ in self.groups), 0)
        if not self.enable_prefix_caching:
            return empty
        bs = self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        cached_flags = []
        hashes_by_group = []
        host = self.host.cache if self.host is not None else None
        for g, m in enumerate(self.groups):
            state = m._state_for(group_key(seq_id, g), extra_keys)
            if len(state.hashes) < max_blocks:
                extend_block_hashes(state.hashes, token_ids, bs, max_blocks, state.extra,
                                    state.media)
            hashes = state.hashes[:max_blocks]
            hashes_by_group.append(hashes)
            flags = [self.pool.cached.get(h) for h in hashes]
            if host is not None:  # blocks only the host holds: ON_HOST
                flags = [ON_HOST if b is None and host.lookup(h) is not None else b
                         for b, h in zip(flags, hashes)]
            cached_flags.append(flags)
        k = self.longest_hit(cached_flags, max_blocks)
        hits = []
        for g, w in enumerate(self.windows):
            skip = self._first_needed(k, w)
            blocks = cached_flags[g][skip:k]
            dev = next((i for i, b in enumerate(blocks) if b is ON_HOST), len(blocks))
            names = hashes_by_group[g][skip:k]
            if dev < len(names) and self.pool.events is not None:  # KV events: their tokens
                self.pool.events.describe_chain(hashes_by_group[g], token_ids, skip + dev, k, g,
                                                extra_keys)
            hits.append(PrefixHit([b.block_id for b in blocks[:dev]], k * bs,
                                  tuple(names[:dev]), tuple(names[dev:]), skip))
        hit = HybridPrefixHit(tuple(hits), k * bs) if k else empty
        if record_stats:
            self.record_prefix_stats(len(token_ids), hit.num_tokens)
        return hit

    def longest_hit(self, flags: Sequence[list], max_blocks: int) -> int:
        """The longest hit in blocks (at most ``max_blocks``) every group accepts, given each
        group's flags per block of its chain: a device block, :data:`ON_HOST` (only a lower
        tier holds it: ``allocate`` loads it) or None (no tier does)."""
        k = max_blocks
        order = sorted(range(len(self.groups)), key=lambda g: self.windows[g] is not None)
        while True:  # full groups first: they cut k to their first gap at once
            before = k
            for g in order:
                k = self._group_hit(flags[g], k, self.windows[g])
            if k == before:
                return k

    def needed_blocks(self, num_blocks: int, group: int) -> range:
        """The chain positions group ``group`` must hold to resume after ``num_blocks``
        blocks: all of them in a full group, the window's in a window group."""
        return range(self._first_needed(num_blocks, self.windows[group]), num_blocks)

    def prompt_chains(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> tuple:
        """Every group's chained block hashes of ``token_ids``' full blocks before its last
        token (what ``find_prefix`` looks up), group order."""
        return tuple(m.prompt_chains(token_ids, extra_keys)[0] for m in self.groups)

    def _first_needed(self, k: int, window: int | None) -> int:
        """The first block a query at position ``k * block_size`` sees through ``window``."""
        if window is None or k == 0:
            return 0
        return max(0, k * self.block_size + 1 - window) // self.block_size

    def _group_hit(self, cached: list, k: int, window: int | None) -> int:
        """The largest ``k' <= k`` this group can resume from: the blocks it needs are device
        blocks followed by host-only blocks (``allocate`` loads those back)."""
        if window is None:  # every block from the first: the longest device-then-host run
            n = 0
            while n < k and cached[n] is not None and cached[n] is not ON_HOST:
                n += 1
            while n < k and cached[n] is ON_HOST:
                n += 1
            return n
        run = 0  # held blocks ending at kk - 1, counted once left to right: O(k) in all
        runs = []
        for b in cached[:k]:
            run = run + 1 if b is not None else 0
            runs.append(run)
        for kk in range(k, 0, -1):
            first = self._first_needed(kk, window)
            if runs[kk - 1] >= kk - first and _device_then_host(cached[first:kk]):
                return kk
        return 0

    def record_prefix_stats(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self._queries += num_queried_tokens
            self._hits += num_hit_tokens

    # -------------------------------------------------------------- allocation
    def _group_prefix(self, prefix, g: int) -> PrefixHit | None:
        if isinstance(prefix, HybridPrefixHit):
            return prefix.groups[g]
        if prefix is not None and (prefix.block_ids or prefix.host_hashes):
            raise ValueError("a hybrid KV cache takes prefix hits from its own find_prefix")
        return None

    def num_blocks_needed(self, seq_id: str, num_tokens: int, prefix=None) -> int:
        return sum(m.num_blocks_needed(group_key(seq_id, g), num_tokens,
                                       self._group_prefix(prefix, g))
                   for g, m in enumerate(self.groups))

    def can_allocate(self, seq_id: str, num_tokens: int, prefix=None) -> bool:
        return self.num_blocks_needed(seq_id, num_tokens, prefix) <= self.pool.num_free_blocks

    # the same room check over every group's blocks (num_blocks_needed sums the groups)
    fit_draft = KVCacheManager.fit_draft

    @staticmethod
    def share_sibling_prefix(hit: HybridPrefixHit, sibling_id: str, sibling_computed: int,
                             num_prompt_tokens: int) -> HybridPrefixHit:
        """``hit``: samples of a request share no blocks in a hybrid cache (a sliding-window
        group's blocks are released as a sibling decodes)."""
        return hit

    def allocate(self, seq_id: str, num_tokens: int, prefix=None) -> list[int] | None:
        """Every group's table covers ``num_tokens`` tokens; None (nothing changed) when the
        pool is short. Returns the new block ids of all groups."""
        hits = [self._group_prefix(prefix, g) for g in range(len(self.groups))]
        if any(h is not None and h.host_hashes for h in hits):
            if self.host is None:
                raise ValueError("the prefix names host-tier blocks but there is no host tier")
            if any(h is not None and self.host.lookup(h.host_hashes) != len(h.host_hashes)
                   for h in hits):
                raise ValueError("stale prefix hit: a host block was evicted since "
                                 "find_prefix; call find_prefix again right before allocate")
        if not self.can_allocate(seq_id, num_tokens, prefix):
            return None
        # Pin every host block of the hit, then take every group's device hit blocks, and only
        # then fresh blocks: one group's fresh blocks (and the spills they cause) must not
        # evict another group's hit blocks, on the device or the host.
        loads = [self.host.prepare_load(h.host_hashes) if h is not None and h.host_hashes
                 else [] for h in hits]
        for g, (m, hit) in enumerate(zip(self.groups, hits)):
            if hit is not None and (hit.block_ids or hit.num_skipped):
                device = PrefixHit(hit.block_ids, (hit.num_skipped + len(hit.block_ids))
                                   * self.block_size, hit.block_hashes, (), hit.num_skipped)
                got = m.allocate(group_key(seq_id, g), device.num_tokens, device)
                assert got == [], "a device hit needs no fresh block"
        new: list[int] = []
        # host hits are each group's tail of the hit: the longest one's tokens came from the
        # host (in some group), counted once
        counted = max(map(len, loads)) * self.block_size if loads else 0
        for g, (m, hit, load) in enumerate(zip(self.groups, hits, loads)):
            ids = m.allocate(group_key(seq_id, g), num_tokens)
            assert ids is not None, "the summed need was checked"
            if load:  # the first fresh blocks take the host blocks' KV and names
                self.host.load(load, ids[:len(load)], hit_tokens=counted)
                counted = 0
                for name, dev in zip(hit.host_hashes, ids):
                    self.pool.register(self.pool.blocks[dev], name)  # may stay private
            new += ids
        return new

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int,
               extra_keys: tuple = ()) -> None:
        for g, m in enumerate(self.groups):
            m.commit(group_key(seq_id, g), token_ids, num_computed_tokens, extra_keys)

    # ----------------------------------------------------------------- release
    def free(self, seq_id: str) -> None:
        for g, m in enumerate(self.groups):
            m.free(group_key(seq_id, g))

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Speculative rollback in every group (ValueError if a window group already released
        a block the cut would need: drafts are never longer than the window allows)."""
        for g, m in enumerate(self.groups):
            m.truncate(group_key(seq_id, g), num_tokens)

    def release_outside_window(self, seq_id: str, num_computed_tokens: int,
                               window: int | None = None) -> int:
        """Every window group gives back its blocks outside its own window (``window`` is
        ignored: each group knows its own). Returns how many blocks went back."""
        return sum(m.release_outside_window(group_key(seq_id, g), num_computed_tokens, w)
                   for g, (m, w) in enumerate(zip(self.groups, self.windows)) if w is not None)

    def evict_middle(self, seq_id: str, start: int, count: int) -> list[int]:
        raise ValueError("streaming eviction is not supported with a hybrid KV cache")

    def reset_prefix_cache(self, host: bool = True) -> bool:
        self.pool.evict_cached_free_blocks()
        if self.host is not None and host:
            self.host.reset()
        if self.pool.events is not None:  # AllBlocksCleared (engine.kv_events)
            self.pool.events.cleared()
        return not self.pool.cached and (self.host is None or not host
                                          or not self.host.pool.cached)

    # ------------------------------------------------------------------- swap
    def swap_cost_blocks(self, seq_id: str, num_tokens: int) -> tuple[int, int]:
        out = back = 0
        for g, m in enumerate(self.groups):
            o, b = m.swap_cost_blocks(group_key(seq_id, g), num_tokens)
            out, back = out + o, back + b
        return out, back

    def swap_is_cheaper(self, seq_id: str, num_tokens: int) -> bool:
        out, back = self.swap_cost_blocks(seq_id, num_tokens)
        cost = self.host.cost if self.host is not None else SwapCostModel(1.0, 0.0)
        return cost.swap_is_cheaper(num_tokens, out, back)

    def swap_out(self, seq_id: str, num_tokens: int) -> bool:
        """Every group's blocks to the host, or nothing (False) if the host's free blocks do
        not cover all of them (a bound: blocks the host already holds would need fewer)."""
        if self.host is None or num_tokens <= 0:
            return False
        states = [m._seqs.get(group_key(seq_id, g)) for g, m in enumerate(self.groups)]
        if any(s is None for s in states):
            return False
        total = sum(len(m._swap_names(s, num_tokens)[0]) for m, s in zip(self.groups, states))
        if total > self.host.pool.num_free_blocks:
            return False
        for g, m in enumerate(self.groups):
            ok = m.swap_out(group_key(seq_id, g), num_tokens)
            assert ok, "the host's free blocks were checked"
        return True

    def swap_in(self, seq_id: str, num_tokens: int) -> list[int] | None:
        """Every group's table back on the device, or None (nothing changed) when the device's
        free blocks do not cover the bound on all of them."""
        if self.host is None or not self.is_swapped(seq_id):
            raise ValueError(f"{seq_id} is not swapped out")
        bs = self.block_size
        total = 0
        for g, m in enumerate(self.groups):
            released = m._swapped[group_key(seq_id, g)].num_released
            total += -(-(num_tokens - released * bs) // bs)
        if total > self.pool.num_free_blocks:
            return None
        table: list[int] = []
        for g, m in enumerate(self.groups):
            ids = m.swap_in(group_key(seq_id, g), num_tokens)
            assert ids is not None, "the device's free blocks were checked"
            table += ids
        return table

    # ----------------------------------------------------------------- copies
    def take_copies(self) -> BlockCopies:
        return self.host.take_copies() if self.host is not None else BlockCopies()

    def complete_copies(self) -> None:
        if self.host is not None:
            self.host.complete_copies()

    def flush_copies(self, copy_fn: CopyFn) -> BlockCopies:
        return self.host.flush_copies(copy_fn) if self.host is not None else BlockCopies()

    # ------------------------------------------------------------------- stats
    def stats(self) -> KVCacheStats:
        free = self.pool.num_free_blocks
        used = self.num_blocks - free
        return KVCacheStats(
            num_blocks=self.num_blocks, num_free_blocks=free, num_used_blocks=used,
            num_cached_blocks=len(self.pool.cached), prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits, usage=used / self.num_blocks,
            num_free_cached_blocks=self.pool.num_free_cached_blocks)

    def offload_stats(self) -> OffloadStats | None:
        return self.host.stats() if self.host is not None else None

    def check_integrity(self) -> None:
        """Every invariant of the shared pool and of each group's tables: a block's
        ``ref_count`` equals the number of tables of all groups holding it; every group knows
        the same sequences; with a host tier, its pool and the swapped sequences of all groups."""
        self.pool.check_integrity()
        refs = [0] * self.num_blocks
        for m in self.groups:
            m._count_table_refs(refs)
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id} has ref_count {block.ref_count} but is held by "
                f"{refs[block.block_id]} tables")
        if not self.enable_prefix_caching:
            assert not self.pool.cached, "prefix caching is disabled but blocks hold hashes"
        keys = [set(m._seqs) | set(m._swapped) for m in self.groups]
        base = keys[0]
        for g, ks in enumerate(keys):
            assert ks == {group_key(s, g) for s in base}, f"group {g}'s sequences out of sync"
        if self.host is None:
            return
        swapped = set()
        for m in self.groups:
            for key, state in m._swapped.items():
                assert key not in m._seqs, f"{key} is both live and swapped"
                assert not state.block_ids, f"swapped {key} still has a device table"
            swapped |= set(m._swapped)
        assert swapped == self.host.swapped_ids(), "swapped sequences out of sync"
        self.host.check_integrity(self.enable_prefix_caching)
