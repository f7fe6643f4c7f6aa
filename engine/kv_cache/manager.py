"""KVCacheManager: per-sequence block tables over the device BlockPool, with prefix sharing,
and the host tier (``engine.kv_cache.host.tier.HostTier``) as a component when there is one.

The scheduler alone calls it; the model side receives block tables as plain data in the step
plan. Per step and running sequence: ``allocate`` (room for the tokens about to be computed)
and, after the forward pass, ``commit`` (register blocks that became full and computed), both
O(new blocks). ``find_prefix`` + ``allocate(prefix=...)`` admit a request on cached blocks;
``free`` ends a sequence; ``truncate`` rolls it back (``engine.kv_cache.rollback``). With a host
tier it also loads host-held prefix blocks back, spills evicted cached blocks and swaps
sequences out and in (``engine.kv_cache.host_swap``); a sequence is live, swapped or unknown,
and ``free`` releases everything exactly once in either state. With a sliding window on every
layer (``release_outside_window``) leading blocks no query can see become :data:`RELEASED`
(never read; they keep their hashes), so a long generation holds O(window) blocks. Block
states and the free queue: :mod:`engine.kv_cache.block_pool`."""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache.block_pool import BlockPool, EvictCallback, KVBlock
from engine.kv_cache.hashing import (
    BlockHash,
    encode_extra_keys,
    extend_block_hashes,
    split_media,
)
from engine.kv_cache.host.blocks import SwapCostModel
from engine.kv_cache.host.tier import HostTier
from engine.kv_cache.host_swap import HostSwap
from engine.kv_cache.rollback import truncate_table
from engine.kv_cache.tables import RELEASED, KVCacheStats, PrefixHit, _SeqState


class KVCacheManager(HostSwap):
    """Paged KV block manager with chained-hash prefix sharing.

    Invariants (asserted by :meth:`check_integrity`): every block is free-uncached, free-cached or
    in use; a block's ``ref_count`` equals the number of block tables holding it;
    ``num_free_blocks + used == num_blocks``; the hash map points only to blocks holding that hash.

    A sequence's record (table and remembered hashes) lives from its first ``find_prefix`` or
    ``allocate`` until ``free``. Call ``free`` for every sequence that ends, including one that
    was looked up but never got blocks, or its remembered hashes stay behind.

    ``on_evict(block_id, block_hash)`` is called when a free-cached block is reused and loses its
    hash, before the block is handed to its new owner (after the host tier's spill, if any).

    ``share_siblings``: samples 2..n of a request may start on sample 1's full prompt blocks
    (:meth:`share_sibling_prefix`), also with prefix caching off.

    ``num_host_blocks > 0`` adds the host tier (``self.host``; None without one); ``cost``
    drives :meth:`swap_is_cheaper`. ``check_integrity`` then covers the host pool too.

    The hybrid manager (``engine.kv_cache.hybrid``) runs one manager per KV group over a shared
    ``pool`` (and ``host`` tier); ``hash_salt`` keeps each group's cache entries apart.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_evict: EvictCallback | None = None,
        *,
        num_host_blocks: int = 0,
        cost: SwapCostModel | None = None,
        pool: BlockPool | None = None,
        host: HostTier | None = None,
        hash_salt: bytes = b"",
        share_siblings: bool = True,
        kv_group: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.share_siblings = share_siblings  # off under streaming eviction
        self._user_on_evict = on_evict
        self._salt = hash_salt
        self.kv_group = kv_group  # the hybrid manager's group index (KV cache events)
        if pool is not None:  # a group of the hybrid manager: pool and host tier are shared
            self.pool, self.host = pool, host
        else:
            self.pool = BlockPool(num_blocks,
                                  on_evict=self._spill if num_host_blocks else on_evict)
            self.host = (HostTier(num_host_blocks, self.pool, block_size, cost)
                         if num_host_blocks else None)
        self._seqs: dict[str, _SeqState] = {}
        # Swapped-out sequences: their hashes and commit progress (the device table is empty).
        self._swapped: dict[str, _SeqState] = {}
        self._queries = 0
        self._hits = 0
        self.num_window_released = 0  # blocks given back by release_outside_window, cumulative

    def _check_live(self, seq_id: str) -> None:
        if seq_id in self._swapped:
            raise ValueError(f"{seq_id} is swapped out: swap_in before anything else")

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Free-uncached plus free-cached blocks: the supply ``allocate`` can draw on."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return (self.num_blocks - self.pool.num_free_blocks) / self.num_blocks

    def block_table(self, seq_id: str) -> list[int]:
        """A copy of ``seq_id``'s block ids in token order ([] for an unknown sequence)."""
        state = self._seqs.get(seq_id)
        return list(state.block_ids) if state else []

    def num_committed_blocks(self, seq_id: str) -> int:
        """How many leading table entries ``commit`` has already registered or skipped."""
        state = self._seqs.get(seq_id)
        return state.num_committed if state else 0

    def prompt_chains(self, token_ids: Sequence[int], extra_keys: tuple = ()) -> tuple:
        """``(chain,)``: the chained block hashes of ``token_ids``' full blocks before its last
        token, as ``find_prefix`` looks them up (this manager's salt included). No state."""
        chain: list[BlockHash] = []
        plain, media = split_media(extra_keys)
        extend_block_hashes(chain, token_ids, self.block_size,
                            max(0, (len(token_ids) - 1) // self.block_size),
                            encode_extra_keys(plain) + self._salt, media)
        return (chain,)

    def block_hashes(self, seq_id: str) -> list[BlockHash]:
        """A copy of ``seq_id``'s chained hashes of its full blocks, as far as computed (a
        released window block's name, too)."""
        state = self._seqs.get(seq_id)
        return list(state.hashes) if state else []

    # ------------------------------------------------------------ prefix lookup
    def find_prefix(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        extra_keys: tuple = (),
        *,
        record_stats: bool = True,
    ) -> PrefixHit:
        """Longest run of cached full blocks matching ``token_ids`` from the start.

        Capped at ``(len(token_ids) - 1) // block_size`` blocks so that the last token is always
        computed (its logits are needed). Takes no references and changes no block: pass the hit
        to :meth:`allocate` before anything else allocates, or the blocks may be evicted (allocate
        then raises ``ValueError``). Adds ``len(token_ids)`` to the query counter and the hit's
        tokens to the hit counter unless ``record_stats`` is False (use that when retrying the
        admission of a request already counted). With prefix caching disabled: the empty hit,
        no stats change. Cost: every full block before the last token is hashed once (SHA-256;
        docs/decisions.md#small-cpu-costs) and remembered for ``commit``; a repeated lookup for the same
        ``seq_id`` only does the dict lookups. With a host tier the device hit is continued by
        blocks the host holds (``PrefixHit.host_hashes``).
        """
        self._check_live(seq_id)
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        state = self._state_for(seq_id, extra_keys)
        bs = self.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        hashes = state.hashes
        if len(hashes) < max_blocks:
            # Hash the whole prompt at once (cheaper per block); commit() reuses these.
            extend_block_hashes(hashes, token_ids, bs, max_blocks, state.extra, state.media)
        cached = self.pool.cached
        block_ids: list[int] = []
        for i in range(max_blocks):
            block = cached.get(hashes[i])
            if block is None:
                break
            block_ids.append(block.block_id)
        hit = PrefixHit(block_ids, len(block_ids) * bs, tuple(hashes[: len(block_ids)]))
        if self.host is not None:
            n = self.host.lookup(hashes[len(block_ids):max_blocks])
            if n:
                if self.pool.events is not None:  # their tokens, for when they are loaded back
                    self.pool.events.describe_chain(hashes, token_ids, len(block_ids),
                                                    len(block_ids) + n, self.kv_group,
                                                    extra_keys)
                host_hashes = tuple(hashes[len(block_ids):len(block_ids) + n])
                hit = PrefixHit(block_ids, hit.num_tokens + n * bs, hit.block_hashes,
                                host_hashes)
        if record_stats:
            self.record_prefix_stats(len(token_ids), hit.num_tokens)
        return hit

    def record_prefix_stats(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix lookup; for callers that looked up with ``record_stats=False`` and
        only count the lookup that led to an admission."""
        if self.enable_prefix_caching:
            self._queries += num_queried_tokens
            self._hits += num_hit_tokens

    # -------------------------------------------------------------- allocation
    def num_blocks_needed(
        self, seq_id: str, num_tokens: int, prefix: PrefixHit | None = None
    ) -> int:
        """Blocks ``allocate`` would take from the free supply: fresh blocks plus prefix blocks
        that are currently free-cached (taking them back removes them from the free queue).
        Host blocks of the hit need fresh device blocks: they count among the fresh ones."""
        prefix = self._device_part(prefix)
        state = self._seqs.get(seq_id)
        have = len(state.block_ids) if state else 0
        prefix_blocks = self._prefix_blocks(have, prefix)
        have += prefix.num_skipped if prefix is not None else 0
        fresh = max(0, -(-num_tokens // self.block_size) - have - len(prefix_blocks))
        return fresh + sum(1 for b in prefix_blocks if b.ref_count == 0)

    def can_allocate(self, seq_id: str, num_tokens: int, prefix: PrefixHit | None = None) -> bool:
        return self.num_blocks_needed(seq_id, num_tokens, prefix) <= self.pool.num_free_blocks

    def fit_draft(self, seq_id: str, num_tokens: int, draft: list[int], budget: int,
                  reserve_blocks: int) -> list[int]:
        """Room for a speculative draft: ``draft`` (tokens after the ``num_tokens`` that
        ``seq_id`` holds) cut to the step's remaining ``budget`` (the sequence's own token
        included), and dropped when its extra blocks would leave fewer than ``reserve_blocks``
        free: a draft never makes the pool preempt anyone. Changes nothing."""
        draft = draft[:max(0, budget - 1)]
        if not draft:
            return []
        need = self.num_blocks_needed(seq_id, num_tokens + len(draft))
        if need and self.num_free_blocks - need < reserve_blocks:
            return []
        return draft

    def share_sibling_prefix(self, hit: PrefixHit, sibling_id: str, sibling_computed: int,
                             num_prompt_tokens: int) -> PrefixHit:
        """Sibling prefix sharing (samples 2..n of one request): ``hit``, or the full prompt
        blocks of the running sibling ``sibling_id`` (``sibling_computed`` tokens computed)
        when they cover more; works with prefix caching off. Never the prompt's last token
        (always a sequence's own) nor a block given back outside the window. Changes nothing;
        ``allocate(prefix=...)`` takes the blocks."""
        if not self.share_siblings:
            return hit
        bs = self.block_size
        n_blocks = min((num_prompt_tokens - 1) // bs, sibling_computed // bs)
        table = self.block_table(sibling_id)[:n_blocks]
        if n_blocks * bs > hit.num_tokens and RELEASED not in table:
            return PrefixHit(block_ids=table, num_tokens=n_blocks * bs)
        return hit

    def allocate(
        self, seq_id: str, num_tokens: int, prefix: PrefixHit | None = None
    ) -> list[int] | None:
        """Make ``seq_id``'s table cover ``num_tokens`` tokens in total (computed + to compute).

        A non-empty ``prefix`` is only accepted while the sequence has no blocks (ValueError
        otherwise): its blocks start the table, each with one more reference, and free-cached
        ones leave the free queue (so they count against the free supply). Fresh blocks are then
        appended, evicting LRU free-cached blocks as needed. Returns the newly appended fresh
        block ids ([] if none were needed). If the pool cannot supply them, returns None and
        changes nothing. Raises ValueError for a stale or malformed prefix. A hit's host blocks
        get the first fresh device blocks, their hashes at once, and a host->device copy each
        (counted as host prefix hits).
        """
        self._check_live(seq_id)
        if prefix is not None and prefix.host_hashes and self.host is not None:
            return self._allocate_with_load(seq_id, num_tokens, prefix)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        state = self._seqs.get(seq_id)
        have = len(state.block_ids) if state else 0
        prefix_blocks = self._prefix_blocks(have, prefix)
        skipped = prefix.num_skipped if prefix is not None else 0
        fresh = max(0, -(-num_tokens // self.block_size) - have - skipped - len(prefix_blocks))
        if not prefix_blocks and fresh == 0 and not skipped:
            # The per-step common case for decoding sequences: nothing to do.
            if state is None:
                self._seqs[seq_id] = _SeqState(extra=self._salt)
            return []
        touched = sum(1 for b in prefix_blocks if b.ref_count == 0)
        if fresh + touched > self.pool.num_free_blocks:
            return None
        if state is None:
            state = self._seqs[seq_id] = _SeqState(extra=self._salt)
        if skipped:  # a window group's hit: the blocks before the window stay released
            state.block_ids.extend([RELEASED] * skipped)
            state.num_released = state.num_committed = skipped
        pool = self.pool
        for block in prefix_blocks:
            pool.touch(block)
            state.block_ids.append(block.block_id)
        new_ids = [b.block_id for b in pool.get_new_blocks(fresh)]
        state.block_ids.extend(new_ids)
        return new_ids

    def _device_part(self, prefix: PrefixHit | None) -> PrefixHit | None:
        if prefix is None or not prefix.host_hashes or self.host is None:
            return prefix
        return PrefixHit(prefix.block_ids,
                         (prefix.num_skipped + len(prefix.block_ids)) * self.block_size,
                         prefix.block_hashes, (), prefix.num_skipped)

    def _prefix_blocks(self, have: int, prefix: PrefixHit | None) -> list[KVBlock]:
        """Validate ``prefix`` against the pool and return its blocks (no state change)."""
        if prefix is not None and prefix.host_hashes:
            raise ValueError("the prefix names host-tier blocks but this manager has no host "
                             "tier (swap_space > 0)")
        if prefix is None or not (prefix.block_ids or prefix.num_skipped):
            return []
        if have:
            raise ValueError(
                "a prefix can only start a block table: the sequence already has blocks"
            )
        n = len(prefix.block_ids)
        if prefix.num_skipped < 0 or prefix.num_tokens != prefix.num_blocks * self.block_size:
            raise ValueError(
                f"prefix of {prefix.num_blocks} blocks must cover "
                f"{prefix.num_blocks * self.block_size} tokens, not {prefix.num_tokens}"
            )
        if prefix.block_hashes and len(prefix.block_hashes) != n:
            raise ValueError("prefix.block_hashes must be empty or match prefix.block_ids")
        if len(set(prefix.block_ids)) != n:
            raise ValueError(f"prefix repeats a block: {prefix.block_ids}")
        blocks = []
        for i, block_id in enumerate(prefix.block_ids):
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"prefix block id {block_id} is outside the pool")
            block = self.pool.blocks[block_id]
            if prefix.block_hashes:
                if block.block_hash != prefix.block_hashes[i]:
                    raise ValueError(
                        f"stale prefix hit: block {block_id} was evicted since find_prefix; "
                        "call find_prefix again right before allocate"
                    )
            elif block.ref_count == 0 and block.block_hash is None:
                raise ValueError(
                    f"prefix block {block_id} is free and holds no KV; share only blocks of a "
                    "live table or a fresh find_prefix hit"
                )
            blocks.append(block)
        return blocks

    # ------------------------------------------------------------ registration
    def commit(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        extra_keys: tuple = (),
    ) -> None:
        """Register as cached every full block within the first ``num_computed_tokens`` tokens.

        ``token_ids`` are the sequence's tokens so far (prompt + outputs). Incremental: blocks
        dealt with by an earlier call are skipped, so a per-step call costs O(new full blocks).
        A block whose hash is already held by another block stays a private duplicate (the
        existing mapping wins); a block already holding a hash (a prefix hit, a sibling's block)
        is left as is. No-op with prefix caching disabled or for an unknown sequence.
        Raises ValueError if ``num_computed_tokens`` exceeds the tokens given or the table.
        """
        if not self.enable_prefix_caching:
            return
        state = self._seqs.get(seq_id)
        if state is None:
            return
        bs = self.block_size
        if num_computed_tokens > len(token_ids) or num_computed_tokens > len(state.block_ids) * bs:
            raise ValueError(
                f"{seq_id}: {num_computed_tokens} computed tokens but {len(token_ids)} tokens and "
                f"room for {len(state.block_ids) * bs} in the block table"
            )
        num_full = num_computed_tokens // bs
        if num_full <= state.num_committed:
            return
        if extra_keys != state.extra_keys:
            self._reset_hashes(state, extra_keys)
        hashes = state.hashes
        if len(hashes) < num_full:
            extend_block_hashes(hashes, token_ids, bs, num_full, state.extra, state.media)
        pool = self.pool
        blocks = pool.blocks
        events = pool.events  # KV cache events: a block's tokens, before it is announced
        for i in range(state.num_committed, num_full):
            block = blocks[state.block_ids[i]]
            if block.block_hash is None:
                if events is not None:
                    events.describe(hashes[i], hashes[i - 1] if i else None,
                                    token_ids[i * bs:(i + 1) * bs], self.kv_group,
                                    state.extra_keys)
                pool.register(block, hashes[i])
        state.num_committed = num_full

    # ----------------------------------------------------------------- release
    def free(self, seq_id: str) -> None:
        """Drop ``seq_id``'s references and forget the sequence, live or swapped (idempotent).

        Blocks reaching ref 0 join the free queue, the table's last block first, so that among
        cached blocks the tail of a sequence is evicted before the head of its prefix (which is
        the part most likely shared). Uncached blocks go to the front of the queue instead: they
        are reused before any cached block is evicted. A swapped sequence's host blocks are
        released; named ones stay in the host prefix cache.
        """
        if self.host is not None:
            self.host.free(seq_id)
            self._swapped.pop(seq_id, None)
        self._free_device(seq_id)

    def _free_device(self, seq_id: str) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        blocks = self.pool.blocks
        for block_id in reversed(state.block_ids[state.num_released:]):
            self.pool.free(blocks[block_id])

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Roll ``seq_id`` back to its first ``num_tokens`` tokens (speculative decoding: the
        accepted ones plus the one still to compute): blocks wholly past them are freed, a
        block left partial stops being a cache entry, and the commit progress and remembered
        hashes shrink to the full blocks kept (``engine.kv_cache.rollback``). Raises
        ValueError for a swapped sequence, a cut inside a shared block or inside the blocks
        released outside a sliding window; an unknown sequence is a no-op."""
        self._check_live(seq_id)
        state = self._seqs.get(seq_id)
        if state is None:
            return
        if num_tokens < state.num_released * self.block_size:
            raise ValueError(f"cannot truncate {seq_id} to {num_tokens} tokens: its first "
                             f"{state.num_released} blocks were released outside the window")
        state.num_committed = truncate_table(self.pool, state.block_ids, state.hashes,
                                             state.num_committed, num_tokens, self.block_size)

    def release_outside_window(self, seq_id: str, num_computed_tokens: int,
                               window: int) -> int:
        """Give back the leading blocks of ``seq_id`` that no query at a position
        ``>= num_computed_tokens`` can see through a sliding ``window`` (a query at ``p`` sees
        keys ``p - window + 1 .. p``): blocks whose last position is below
        ``num_computed_tokens + 1 - window``. With prefix caching only committed blocks go
        (they keep their hash: free-cached, shareable). Their entries become ``RELEASED``;
        returns how many were released now. Cost O(released blocks)."""
        state = self._seqs.get(seq_id)
        if state is None:
            return 0
        n = max(0, num_computed_tokens + 1 - window) // self.block_size
        n = min(n, len(state.block_ids))
        if self.enable_prefix_caching:
            n = min(n, state.num_committed)
        if n <= state.num_released:
            return 0
        blocks = self.pool.blocks
        for i in range(state.num_released, n):
            self.pool.free(blocks[state.block_ids[i]])
            state.block_ids[i] = RELEASED
        released = n - state.num_released
        state.num_released = n
        self.num_window_released += released
        return released

    def evict_middle(self, seq_id: str, start: int, count: int) -> list[int]:
        """Streaming eviction (``engine.kv_cache.streaming``): take table entries
        ``start .. start + count - 1`` out of ``seq_id``'s table and free their blocks; the
        entries behind them move up by ``count`` (the table stays dense: cache positions).
        Returns the moved block ids, which the caller re-rotates. Needs private blocks
        (ValueError for a shared one: it is rotated in place) and no window release."""
        state = self._seqs.get(seq_id)
        if state is None or count <= 0:
            return []
        ids = state.block_ids
        if state.num_released or start + count > len(ids):
            raise ValueError(f"{seq_id}: cannot evict blocks {start}..{start + count - 1} of "
                             f"a table of {len(ids)} ({state.num_released} released)")
        blocks = self.pool.blocks
        moved = ids[start + count:]
        if any(blocks[b].ref_count != 1 for b in ids[start:]):
            raise ValueError(f"{seq_id}: streaming eviction needs private blocks")
        for b in ids[start:start + count]:
            self.pool.free(blocks[b])
        del ids[start:start + count]
        state.num_committed = min(state.num_committed, start)
        del state.hashes[start:]
        return list(moved)

    def num_live_blocks(self, seq_id: str) -> int:
        """Blocks ``seq_id`` holds now (its table less the released entries)."""
        state = self._seqs.get(seq_id)
        return len(state.block_ids) - state.num_released if state else 0

    def reset_prefix_cache(self, host: bool = True) -> bool:
        """Drop the hash of every free block (their KV is forgotten, not written back).

        Returns True if no block holds a hash afterwards; False if blocks in use keep theirs
        (they stay shareable until freed and reused). The host tier drops its free cached
        blocks too, unless ``host`` is False (the device pool alone).
        """
        self.pool.evict_cached_free_blocks()
        if self.host is not None and host:
            self.host.reset()
        if self.pool.events is not None:  # AllBlocksCleared (engine.kv_events)
            self.pool.events.cleared()
        return not self.pool.cached and (self.host is None or not host
                                          or not self.host.pool.cached)

    # ------------------------------------------------------------------- stats
    def stats(self) -> KVCacheStats:
        free = self.pool.num_free_blocks
        used = self.num_blocks - free
        cached = self.pool.cached
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=free,
            num_used_blocks=used,
            num_cached_blocks=len(cached),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            usage=used / self.num_blocks,
            num_free_cached_blocks=self.pool.num_free_cached_blocks,
        )

    def check_integrity(self) -> None:
        """Assert every invariant (O(num_blocks + table lengths)); for tests and debugging.
        With a host tier also the host pool's, and: swapped sequences are not live and hold no
        device table."""
        self._check_device()
        self._check_host()

    def _check_device(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.num_blocks
        self._count_table_refs(refs)
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id} has ref_count {block.ref_count} but is held by "
                f"{refs[block.block_id]} tables"
            )
        if not self.enable_prefix_caching:
            assert not self.pool.cached, "prefix caching is disabled but blocks hold hashes"

    def _count_table_refs(self, refs: list[int]) -> None:
        """Assert each live table's shape and add one to ``refs[b]`` per table entry ``b``."""
        for seq_id, state in self._seqs.items():
            held = state.block_ids[state.num_released:]
            assert all(b == RELEASED for b in state.block_ids[:state.num_released]) and \
                RELEASED not in held, f"{seq_id}: released entries out of place"
            assert len(set(held)) == len(held), (
                f"{seq_id}'s table holds a block twice: {state.block_ids}"
            )
            assert state.num_committed <= len(state.block_ids), (
                f"{seq_id}: {state.num_committed} committed blocks but a table of "
                f"{len(state.block_ids)}"
            )
            for block_id in held:
                refs[block_id] += 1

    # ---------------------------------------------------------------- helpers
    def _state_for(self, seq_id: str, extra_keys: tuple) -> _SeqState:
        state = self._seqs.get(seq_id)
        if state is None:
            state = self._seqs[seq_id] = _SeqState()
            self._reset_hashes(state, extra_keys)
        elif extra_keys != state.extra_keys:
            self._reset_hashes(state, extra_keys)
        return state

    def _reset_hashes(self, state: _SeqState, extra_keys: tuple) -> None:
        plain, state.media = split_media(extra_keys)
        state.extra = encode_extra_keys(plain) + self._salt
        state.extra_keys = extra_keys
        state.hashes = []
