"""A read-only picture of the KV cache at one instant: :class:`KVSnapshot`.

What the live page (``/kv``, server/kv_page/) and ``/kv/state`` show, taken ON THE ENGINE
THREAD (``EngineCore.kv_snapshot``, through ``AsyncEngine.call_on_engine_thread``), so it never
sees a half-done step. It reads public state only and changes nothing; one costs O(num_blocks +
the running tables) of plain Python (docs/decisions.md#small-cpu-costs).

Contents: the pool's tiers (:class:`TierState`: device, host, and ``KVSnapshotter.extra_tiers``
such as the disk tier), one character per device block (:data:`BLOCK_STATES`), the running
sequences with their tables and shared prefixes, the largest shared prefixes seen so far
(:class:`PrefixTracker`, token ids), cumulative counters and the geometry for the §3.1
arithmetic (:class:`KVGeometry`). Hybrid KV models have one block table per group and sequence:
:attr:`KVSnapshot.groups` names the groups, each :class:`SeqKV` lists its blocks per group, and
its counts cover every group."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# One character per device block, in block-id order.
BLOCK_STATES = {
    "f": "free (no cached KV)",
    "c": "cached and evictable (free, holds a prefix-cache hash)",
    "u": "in use by one sequence",
    "s": "in use and shared by several sequences",
}
MAX_TABLE_IDS = 512  # block ids listed per sequence (the count is always exact)
PREFIX_TOKENS = 32  # first tokens kept of a shared prefix


@dataclass(frozen=True)
class KVGeometry:
    """The running configuration's KV layout: bytes per token is
    ``2 (K and V) x num_layers x num_kv_heads x row_bytes`` (``row_bytes``: ``head_dim`` elements
    of the cache dtype, plus a scale for int8)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str
    row_bytes: int
    block_size: int
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "row_bytes", "block_size",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVGeometry.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass(frozen=True)
class TierState:
    """One tier's blocks by state; ``free + cached_free + used == num_blocks``."""

    name: str  # "device" | "host" | "disk" | ...
    num_blocks: int
    free: int  # free, no cached KV
    cached_free: int  # free but holding a prefix-cache hash (evictable)
    used: int  # held by a sequence (or pinned by a pending copy)
    cached: int  # holding a hash, in use or free


@dataclass(frozen=True)
class SeqKV:
    """One running (or swapped-out) sequence's KV."""

    seq_id: str
    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_blocks: int  # blocks its table holds now
    block_ids: tuple[int, ...]  # the first MAX_TABLE_IDS of them (-1: released)
    num_shared_blocks: int  # leading blocks another sequence holds too
    num_cached_tokens: int  # its prefix-cache hit at admission
    swapped: bool = False
    # hybrid layouts only: per KV group, the first MAX_TABLE_IDS block ids of its table
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    group_num_blocks: tuple[int, ...] = ()  # blocks held now, per group


@dataclass(frozen=True)
class KVGroupView:
    """One KV cache group of a hybrid layout: its layers and their window (None: full)."""

    group: int
    num_layers: int
    window: int | None


@dataclass(frozen=True)
class SharedPrefix:
    """A prefix requests reused (:class:`PrefixTracker`)."""

    num_tokens: int
    num_requests: int  # requests that reused it (hit it, or held it with another)
    first_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCounters:
    """Cumulative since start-up."""

    prefix_queries: int  # tokens looked up
    prefix_hits: int  # tokens found
    evictions: int  # cached device blocks reused for other KV
    spills: int  # evicted device blocks copied to the host
    loads: int  # blocks copied host -> device (prefix load-backs and swap-ins)
    offloads: int  # blocks copied device -> host (spills and swap-outs)
    host_evictions: int

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(frozen=True)
class KVSnapshot:
    """The whole picture (module docstring). ``seq_no`` grows by one per snapshot."""

    seq_no: int
    time: float
    geometry: KVGeometry
    tiers: tuple[TierState, ...]
    blocks: str  # one BLOCK_STATES character per device block
    seqs: tuple[SeqKV, ...]
    shared_prefixes: tuple[SharedPrefix, ...]
    counters: KVCounters
    live_tokens: int = 0  # token slots of device blocks holding computed KV (shared: once)
    prefix_caching: bool = True
    groups: tuple[KVGroupView, ...] = ()  # hybrid layouts only (one group: empty)
    extra: dict[str, Any] = field(default_factory=dict)

    def tier(self, name: str) -> TierState | None:
        return next((t for t in self.tiers if t.name == name), None)


def pool_tier(name: str, pool: Any) -> TierState:
    """A :class:`TierState` from a ``BlockPool`` (device or host)."""
    free_total = pool.num_free_blocks
    cached_free = pool.num_free_cached_blocks
    return TierState(name=name, num_blocks=pool.num_blocks, free=free_total - cached_free,
                     cached_free=cached_free, used=pool.num_blocks - free_total,
                     cached=len(pool.cached))


def block_states(pool: Any) -> str:
    """One :data:`BLOCK_STATES` character per block of ``pool``."""
    return "".join(
        ("s" if b.ref_count > 1 else "u") if b.ref_count else ("c" if b.block_hash is not None
                                                               else "f")
        for b in pool.blocks)


class PrefixTracker:
    """The largest prefixes requests reused, across snapshots (engine thread only).

    A request counts for a prefix when it found it cached at admission (its prefix hit: every
    finished request is offered, ``EngineCore.step``) or held its leading blocks together with
    another sequence (seen by a snapshot). Entries are keyed by their first
    :data:`PREFIX_TOKENS` tokens, keep the longest extent seen and the distinct requests, and
    at most ``capacity`` entries stay (the shortest go first). O(1) per observation."""

    def __init__(self, capacity: int = 32) -> None:
        if capacity < 1:
            raise ValueError(f"PrefixTracker capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: dict[tuple[int, ...], list[Any]] = {}  # head -> [num_tokens, {ids}]

    def observe(self, num_tokens: int, request_id: str, token_ids: list[int]) -> None:
        if num_tokens <= 0:
            return
        head = tuple(token_ids[:min(num_tokens, PREFIX_TOKENS)])
        entry = self._entries.get(head)
        if entry is None:
            if len(self._entries) >= self.capacity:
                shortest = min(self._entries, key=lambda k: self._entries[k][0])
                del self._entries[shortest]
            entry = self._entries[head] = [0, set()]
        entry[0] = max(entry[0], num_tokens)
        if len(entry[1]) < 10_000:
            entry[1].add(request_id)

    def top(self, n: int = 8) -> tuple[SharedPrefix, ...]:
        """The ``n`` longest prefixes (then the most reused)."""
        best = sorted(self._entries.items(), key=lambda kv: (-kv[1][0], -len(kv[1][1])))[:n]
        return tuple(SharedPrefix(e[0], len(e[1]), head) for head, e in best)


class KVSnapshotter:
    """Builds :class:`KVSnapshot` s of one manager (engine thread only)."""

    def __init__(self, kv: Any, geometry: KVGeometry) -> None:
        self.kv = kv
        self.geometry = geometry
        self.prefixes = PrefixTracker()
        # further tiers below the host (the disk tier): objects with tier_state() -> TierState
        self.extra_tiers: list[Any] = []
        self._seq_no = 0
        layout = getattr(kv, "layout", None)
        self.groups: tuple[KVGroupView, ...] = tuple(
            KVGroupView(g, len(spec.layers), spec.window)
            for g, spec in enumerate(layout.groups)) if layout is not None else ()

    def take(self, seqs: Iterable[Any]) -> KVSnapshot:
        """A snapshot; ``seqs`` are the scheduler's running sequences (``engine.request``
        ``Sequence`` objects: ``seq_id``, ``request``, ``token_ids``, ``num_computed_tokens``)."""
        kv = self.kv
        pool = kv.pool
        blocks = pool.blocks
        bs = self.geometry.block_size
        seq_views = []
        filled: dict[int, int] = {}  # device block -> slots holding computed KV
        for seq in seqs:
            tables = kv.group_tables(seq.seq_id) if self.groups else (kv.block_table(seq.seq_id),)
            table = tables[0]
            swapped = bool(kv.is_swapped(seq.seq_id)) if hasattr(kv, "is_swapped") else False
            held_per_group = tuple(sum(1 for b in t if b >= 0) for t in tables)
            for t in tables:  # a block belongs to one group; released window blocks are -1
                for i, b in enumerate(t):
                    n = min(bs, seq.num_computed_tokens - i * bs)
                    if n <= 0:
                        break
                    if b >= 0 and filled.get(b, 0) < n:
                        filled[b] = n
            shared = 0
            for b in table:
                if b < 0 or blocks[b].ref_count < 2:
                    break
                shared += 1
            cached_tokens = seq.request.num_cached_tokens or 0
            prefix_tokens = max(shared * bs, cached_tokens)
            if prefix_tokens:
                self.prefixes.observe(prefix_tokens, seq.request.request_id, seq.token_ids)
            seq_views.append(SeqKV(
                seq_id=seq.seq_id, request_id=seq.request.request_id,
                num_tokens=len(seq.token_ids), num_computed_tokens=seq.num_computed_tokens,
                num_blocks=sum(held_per_group), block_ids=tuple(table[:MAX_TABLE_IDS]),
                num_shared_blocks=shared, num_cached_tokens=cached_tokens, swapped=swapped,
                group_block_ids=tuple(tuple(t[:MAX_TABLE_IDS]) for t in tables)
                if self.groups else (),
                group_num_blocks=held_per_group if self.groups else ()))
        tiers = [pool_tier("device", pool)]
        host = getattr(kv, "host", None)
        if host is not None:
            tiers.append(pool_tier("host", host.pool))
        tiers.extend(extra.tier_state() for extra in self.extra_tiers)
        stats = kv.stats()
        off = kv.offload_stats() if hasattr(kv, "offload_stats") else None
        counters = KVCounters(
            prefix_queries=stats.prefix_cache_queries, prefix_hits=stats.prefix_cache_hits,
            evictions=getattr(pool, "num_evictions", 0),
            spills=off.spills if off else 0, loads=off.blocks_h2d if off else 0,
            offloads=off.blocks_d2h if off else 0,
            host_evictions=off.host_evictions if off else 0)
        self._seq_no += 1
        return KVSnapshot(seq_no=self._seq_no, time=time.time(), geometry=self.geometry,
                          tiers=tuple(tiers), blocks=block_states(pool), seqs=tuple(seq_views),
                          shared_prefixes=self.prefixes.top(),
                          counters=counters, live_tokens=sum(filled.values()),
                          prefix_caching=bool(getattr(kv, "enable_prefix_caching", True)),
                          groups=self.groups)
