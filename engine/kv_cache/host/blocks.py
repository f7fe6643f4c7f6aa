"""The host tier's bookkeeping: host blocks, the host prefix cache, and one step's block copies.

The host pool mirrors the device pool (same layout, tensors in ``ModelRunner.host_kv_caches``,
same chained block hashes); its metadata is a second :class:`~engine.kv_cache.block_pool.BlockPool`,
so a host block is in use (held by a swapped-out sequence and/or *pinned* by a pending copy of
this step, dropped by :meth:`HostKVCache.finish_copies`), free-cached (the host prefix cache, LRU)
or free-uncached.

Copies are only *recorded* while the scheduler runs and executed once per step, before the
model runs, device->host first and host->device second: a device block spilled and then reused
as a load-back's destination is read before it is overwritten, and a host block written by a
spill and then loaded back is written before it is read. Pins make sure no host block is the
destination of two copies, or overwritten while a copy still has to read it, within one step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.hashing import BlockHash

# Rough device rates behind the "auto" preemption choice (see SwapCostModel.for_model). They
# only need the right order of magnitude: the choice is between costs that differ by orders
# of magnitude (the CPU rates' origin: docs/decisions.md#preemption-cost-model).
_PREFILL_FLOPS = {"cpu": 1.0e11, "cuda": 1.0e14}
_COPY_BYTES_PER_S = {"cpu": 1.0e9, "cuda": 1.0e10}


@dataclass
class BlockCopies:
    """One step's batched copies. ``d2h``: (device block, host block); ``h2d``: (host block,
    device block). Destinations are distinct within each list."""

    d2h: list[tuple[int, int]] = field(default_factory=list)
    h2d: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.d2h or self.h2d)


@dataclass(frozen=True)
class SwapCostModel:
    """Expected seconds to recompute one token (prefill) or to move one block one way."""

    seconds_per_token: float
    seconds_per_block: float

    def __post_init__(self) -> None:
        if self.seconds_per_token < 0 or self.seconds_per_block < 0:
            raise ValueError("SwapCostModel costs cannot be negative")

    @classmethod
    def for_model(cls, arch, device_type: str, block_bytes: int) -> SwapCostModel:
        """Priors from the model shape: 2 FLOPs per non-embedding weight per token (plus the
        logits are not needed for a recomputed prompt), against a nominal prefill rate and a
        nominal copy bandwidth of ``device_type``."""
        h, hd = arch.hidden_size, arch.head_dim
        per_layer = (h * (arch.num_heads + 2 * arch.num_kv_heads) * hd
                     + arch.num_heads * hd * h + 3 * h * arch.intermediate_size)
        flops = 2.0 * arch.num_layers * per_layer
        kind = device_type if device_type in _PREFILL_FLOPS else "cpu"
        return cls(flops / _PREFILL_FLOPS[kind], block_bytes / _COPY_BYTES_PER_S[kind])

    def swap_is_cheaper(self, num_tokens: int, num_blocks_out: int, num_blocks_in: int) -> bool:
        """Swap if moving the blocks out and back costs less than recomputing the tokens."""
        swap = (num_blocks_out + num_blocks_in) * self.seconds_per_block
        return swap < num_tokens * self.seconds_per_token


@dataclass
class OffloadStats:
    """Host tier counters; block counts are cumulative since start-up, tokens too."""

    num_host_blocks: int
    host_blocks_used: int  # held by swapped-out sequences or pinned by a pending copy
    host_blocks_cached: int  # holding a hash (in use or free): what a prefix lookup can find
    host_blocks_free: int
    blocks_d2h: int
    blocks_h2d: int
    host_prefix_hit_tokens: int  # prompt tokens loaded back from the host instead of computed
    host_evictions: int  # host-cached blocks dropped by host LRU to make room
    spills: int  # evicted device blocks written back to the host
    spills_skipped: int  # evicted device blocks the host already held
    spills_dropped: int  # evicted device blocks lost because every host block was in use
    num_swapped_seqs: int = 0
    host_blocks_cached_free: int = 0  # evictable host-cached blocks

    @property
    def host_usage(self) -> float:
        """Fraction of host blocks holding data (in use or cached)."""
        if not self.num_host_blocks:
            return 0.0
        holding = self.num_host_blocks - self.host_blocks_free + self.host_blocks_cached_free
        return holding / self.num_host_blocks


class HostKVCache:
    """Host block states, the host prefix cache (hash -> host block, LRU) and pending copies.

    Knows nothing of sequences: :class:`engine.kv_cache.host.tier.HostTier` keeps the swapped-out
    sequences' host tables, and the device ``KVCacheManager`` decides what to spill, load or swap.
    """

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, on_evict=self._on_host_evict)
        self.num_blocks = num_blocks
        self._copies = BlockCopies()
        self._pins: list[KVBlock] = []
        self._d2h_dst: set[int] = set()  # host blocks written this step
        self._h2d_src: dict[int, KVBlock] = {}  # device block -> host block loaded into it
        self.blocks_d2h = 0
        self.blocks_h2d = 0
        self.host_evictions = 0
        self.spills = 0
        self.spills_skipped = 0
        self.spills_dropped = 0
        # Told of every named host block about to be reused, its bytes still intact (the disk
        # tier's on-evict writes).
        self.evict_listener: Callable[[int, BlockHash], None] | None = None
        # Told of every device block whose spill is dropped (no host block free), its bytes
        # still intact: (device block id, hash).
        self.drop_listener: Callable[[int, BlockHash], None] | None = None

    def _on_host_evict(self, block_id: int, block_hash: BlockHash) -> None:
        self.host_evictions += 1
        if self.evict_listener is not None:
            self.evict_listener(block_id, block_hash)

    # ---- lookups and references ------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.pool.lookup(block_hash)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new reservation may take (free-cached ones by evicting them)."""
        return self.pool.num_free_blocks

    def pin(self, block: KVBlock) -> None:
        """Take a reference on ``block`` that :meth:`finish_copies` drops (a pending copy)."""
        self.pool.touch(block)
        self._pins.append(block)

    def adopt_pin(self, block: KVBlock) -> None:
        """Turn a reference the caller holds on ``block`` into a pin."""
        self._pins.append(block)

    def new_pinned_block(self) -> KVBlock:
        """A fresh host block whose only reference is a pin, evicting host LRU if needed.
        The caller checks :attr:`num_free_blocks` first."""
        block = self.pool.get_new_blocks(1)[0]
        self._pins.append(block)
        return block

    # ---- copies ----------------------------------------------------------------------
    def record_d2h(self, device_block: int, host_block: KVBlock) -> None:
        """Copy ``device_block`` into the pinned ``host_block`` when the step's copies run."""
        assert host_block.block_id not in self._d2h_dst, "host block written twice in a step"
        self._d2h_dst.add(host_block.block_id)
        self._copies.d2h.append((device_block, host_block.block_id))

    def record_h2d(self, host_block: KVBlock, device_block: int) -> None:
        """Copy the pinned ``host_block`` into ``device_block`` when the step's copies run.

        A device block given a new load in the same step (it was freed and handed out again
        before the copies ran) only needs the last one: the earlier copy is dropped."""
        earlier = self._h2d_src.get(device_block)
        if earlier is not None:
            self._copies.h2d.remove((earlier.block_id, device_block))
        self._copies.h2d.append((host_block.block_id, device_block))
        self._h2d_src[device_block] = host_block

    def pending_source(self, device_block: int) -> KVBlock | None:
        """The host block a pending copy will load into ``device_block``, if any: until the
        copies run, that host block, not the device block, holds the device block's KV."""
        return self._h2d_src.get(device_block)

    def spill(self, device_block: int, block_hash: BlockHash) -> None:
        """An evicted device block named ``block_hash`` is about to be reused: keep its KV.

        Skipped when the host already holds the hash (its LRU position is refreshed); dropped
        when every host block is in use. Otherwise a host block (evicting host LRU) receives the
        copy and the hash at once, so lookups later in the same step already find it.
        """
        held = self.pool.lookup(block_hash)
        if held is not None:
            self.spills_skipped += 1
            if held.ref_count == 0:  # move to the most recently used end
                self.pool.touch(held)
                self.pool.free(held)
            return
        if self.pool.num_free_blocks == 0:
            self.spills_dropped += 1
            if self.drop_listener is not None:
                self.drop_listener(device_block, block_hash)
            return
        block = self.new_pinned_block()  # the pin keeps it until the copy has run
        self.pool.register(block, block_hash)
        self.record_d2h(device_block, block)
        self.spills += 1

    @property
    def pending(self) -> BlockCopies:
        """The copies recorded since the last :meth:`finish_copies` (read-only view)."""
        return self._copies

    def take_copies(self) -> BlockCopies:
        """Hand out this step's copies (to execute now), counting them; pins stay."""
        copies, self._copies = self._copies, BlockCopies()
        self.blocks_d2h += len(copies.d2h)
        self.blocks_h2d += len(copies.h2d)
        return copies

    def finish_copies(self) -> None:
        """The copies handed out by :meth:`take_copies` have run: drop their pins."""
        assert not self._copies, "copies were recorded after take_copies"
        for block in self._pins:
            self.pool.free(block)
        self._pins = []
        self._d2h_dst = set()
        self._h2d_src = {}

    def pin_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for block in self._pins:
            counts[block.block_id] = counts.get(block.block_id, 0) + 1
        return counts

    def reset(self) -> None:
        """Forget every free host-cached block (their KV is discarded, not counted as evicted)."""
        self.pool.evict_cached_free_blocks()

    # ---- checks and stats ------------------------------------------------------------
    def check_integrity(self, holders: dict[int, int]) -> None:
        """Assert the host pool's invariants. ``holders``: host block id -> references held by
        swapped-out sequences; pins account for the rest of every ``ref_count``."""
        self.pool.check_integrity()
        pins = self.pin_counts()
        for block in self.pool.blocks:
            want = holders.get(block.block_id, 0) + pins.get(block.block_id, 0)
            assert block.ref_count == want, (
                f"host block {block.block_id} has ref_count {block.ref_count} but "
                f"{holders.get(block.block_id, 0)} swapped holders and "
                f"{pins.get(block.block_id, 0)} pins")
        c = self._copies
        d2h_dst = [h for _, h in c.d2h]
        assert len(set(d2h_dst)) == len(d2h_dst), "two copies write one host block"
        assert set(d2h_dst) == self._d2h_dst, "pending host destinations out of sync"
        h2d_dst = [d for _, d in c.h2d]
        assert len(set(h2d_dst)) == len(h2d_dst), "two copies write one device block"
        for h in d2h_dst + [h for h, _ in c.h2d]:
            assert pins.get(h, 0) > 0, f"host block {h} takes part in a copy but is not pinned"

    def stats(self, host_prefix_hit_tokens: int, num_swapped_seqs: int) -> OffloadStats:
        pool = self.pool
        used = self.num_blocks - pool.num_free_blocks
        return OffloadStats(
            num_host_blocks=self.num_blocks, host_blocks_used=used,
            host_blocks_cached=len(pool.cached), host_blocks_free=pool.num_free_blocks,
            blocks_d2h=self.blocks_d2h, blocks_h2d=self.blocks_h2d,
            host_prefix_hit_tokens=host_prefix_hit_tokens, host_evictions=self.host_evictions,
            spills=self.spills, spills_skipped=self.spills_skipped,
            spills_dropped=self.spills_dropped, num_swapped_seqs=num_swapped_seqs,
            host_blocks_cached_free=pool.num_free_cached_blocks)
