"""DiskTier: the engine's facade over the disk store, under the host tier.

The engine thread drives it: on a request's arrival the blocks of the longest prompt hit that
only the disk holds get host blocks and a read job for the reader thread (the load overlaps
other requests' steps); at the admission gate the prompt is looked up again; finished reads are
named in the host prefix cache (``poll``), where the scheduler's ordinary prefix look-up finds
and loads them back (``cached_tokens`` counts them like host hits); writes go to the writer
thread by ``--kv-disk-write-policy`` (``write-through`` or ``on-evict``). Each step of that flow
is spelled out on :class:`DiskTier`.

Under tensor parallelism this facade runs on rank 0 and decides for every rank; each rank's
store holds its share of a block under its own fingerprint (``shards``). The store is a
``DiskStore``, or with ``--kv-remote-url`` a ``ChainStore`` (``engine.kv_cache.remote``) behind
the same interface. Block bytes on disk: each pool tensor's K then V block, as stored
(``block_bytes`` in all; a hybrid cache's block is one group's layers, its hash salted)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.kv_cache.disk.plan import ReadPlan, plan_chain, plan_groups
from engine.kv_cache.disk.prefetch import Prefetcher, PrefetchJob
from engine.kv_cache.disk.segment import RECORD_HEADER_BYTES
from engine.kv_cache.disk.stats import DiskTierStats
from engine.kv_cache.disk.store import DiskStore
from engine.kv_cache.host.blocks import SwapCostModel
from engine.kv_cache.hybrid import HybridKVCacheManager, group_key
from engine.kv_cache.snapshot import TierState
from engine.request import SeqStatus
from engine.request import Sequence as Seq

logger = logging.getLogger("kvserve.engine")
KVPools = Sequence[tuple[torch.Tensor, torch.Tensor]]
_DISK_BYTES_PER_S = 5.0e8  # nominal read rate behind the wait-or-recompute choice
_GATE_WAIT_S = 10.0  # the most the engine waits for a request's reads when idle
_GATE_LOOKUPS = 3  # look-ups at the gate per request (a bound on re-reading evicted blocks)


@dataclass
class _Prompt:
    """A request's prompt as the admission gate looks it up again."""

    seq: Seq  # its status says whether it still waits
    chains: tuple  # its full blocks' chained hashes, one chain per KV group
    lookups_left: int = _GATE_LOOKUPS


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([blocks, ...]) as uint8 [blocks, bytes per block]."""
    return t.view(torch.uint8).reshape(t.shape[0], -1)


class DiskTier:
    """The flow, by the engine thread unless said otherwise:

    * **Arrival** (``on_arrival``, from ``EngineCore.add_request``): the prompt's chained hashes
      are looked up device -> host -> disk. The blocks of the longest hit that only the disk
      holds (``engine.kv_cache.disk.plan``: the run after what memory holds; with a hybrid KV
      cache, each group's chain and the blocks its window needs) get host blocks (at most half
      of the free host blocks, one reference each) and a read job for the reader thread: the
      load overlaps other requests' steps while the request waits in the queue.
    * **At the gate** the prompt is looked up again (at most ``_GATE_LOOKUPS`` times): blocks
      the device or host held on arrival may have been evicted since, and blocks the staging
      area could not take then may fit now; this read may take every free host block but its
      own host hits, and the blocks held for the requests behind it are released for it first.
    * **Arrived** (``poll``, at the start of every step and from the gate): each finished job's
      verified blocks are named in the host prefix cache and kept referenced while the request
      waits (the device's spills cannot take them), then released (free-cached, head of the
      chain most recently used) at the first step after it left the queue; its unread blocks
      are released unnamed at once. The scheduler's ordinary prefix look-up then finds them in
      the host tier and loads them back to the device: ``cached_tokens`` counts them like host
      hits.
    * **Admission gate** (``ready``, ``Scheduler.admission_gate``): a request whose blocks are
      still loading is admitted once they arrived; while the scheduler has other work it waits
      in the queue; with nothing else to run the engine thread waits for its reads (bounded).
      If the cost model says recomputing its tokens is cheaper than reading them, it is
      admitted at once (blocks that arrive later still go to the host cache).
    * **Writes**, by ``--kv-disk-write-policy``. ``write-through`` (``after_step``, after every
      step's commit): blocks a sequence has just committed, in every KV group (a window group's
      blocks that slid out in the same step too), are copied out of the device pools and
      queued for the writer thread. ``on-evict`` (``_on_host_evict``, the host pool's eviction
      hook): a named host block about to be reused is queued from host memory, and so is a
      device block whose spill to the host was dropped (no host block free); at a clean
      shutdown every named block still in host or device memory is written back. Either way a
      full queue drops the block, and a hash the disk already holds is skipped.

    Tensor parallelism (``shards``, set by ``engine.kv_cache.disk.build``): ``shards``
    (``engine.distributed.kv_tiers``) sends the other ranks each read job (the same hashes into
    the same host blocks of their own pools) and each write (each rank skipping what its store
    holds); a finished read counts only the leading blocks every rank read and verified (the
    minimum over ranks, agreed in ``poll``), so that every rank then loads the same blocks.

    A ``ChainStore`` store adds ``read_many`` (batched reads), ``stored_everywhere`` (write
    skipping), ``probe`` (a hybrid cache's look-up) and ``remote_snapshot``.
    """

    def __init__(self, store: DiskStore, kv, device_pools: KVPools, host_pools: KVPools,
                 cost: SwapCostModel | None = None,
                 settle_host: Callable[[], None] | None = None) -> None:
        """``kv``: the engine's ``KVCacheManager`` or ``HybridKVCacheManager``, with a host
        tier (the staging area). ``device_pools``: the distinct pool tensors (a hybrid cache's
        slots, not one entry per layer), ``host_pools`` likewise.
        ``settle_host``: lands deferred device->host write-backs (CUDA) before host blocks are
        handed to the reader thread: a block reserved for a read may have been the target of
        the last step's spill, whose bytes must not land after the read's."""
        if kv.host is None:
            raise ValueError("the disk KV tier loads blocks through host memory: the KV "
                             "manager needs a host tier")
        self.store = store
        self.kv = kv
        self.block_size = kv.block_size
        self._device = [t for kv in device_pools for t in kv]
        # numpy views of the host pools (uint8 [blocks, bytes]): the reader thread's copies
        # (60+ per block) cost several times less this way than through torch
        # (docs/decisions.md#small-cpu-costs)
        self._host = [_flat_bytes(t).numpy() for kv in host_pools for t in kv]
        self._host_widths = [h.shape[1] for h in self._host]
        self.block_bytes = sum(self._host_widths)
        if self.block_bytes != store.block_bytes:
            raise ValueError(f"disk store blocks of {store.block_bytes} bytes for pools of "
                             f"{self.block_bytes}")
        self.cost = cost
        self._settle_host = settle_host
        self._jobs: dict[str, PrefetchJob] = {}
        self._written: dict[str, int] = {}  # group key -> table entries already considered
        # (group key, manager) of a sequence's tables: one, or one per group of a hybrid cache
        self._groups = (list(enumerate(kv.groups)) if isinstance(kv, HybridKVCacheManager)
                        else [(0, kv)])
        self._recent: set[bytes] = set()  # queued for writing lately (not yet in the index)
        self._prompts: dict[str, _Prompt] = {}  # seq id -> its prompt (until it ends)
        # seq id -> host blocks its finished reads filled: referenced (so that spills cannot
        # evict them) until it leaves the waiting queue
        self._held: dict[str, list] = {}
        self._prefetcher = Prefetcher(store.read, self._write_host_block,
                                      getattr(store, "read_many", None))
        # whether a block needs no write: held by every store (a ChainStore), or the disk's
        self._stored = getattr(store, "stored_everywhere", store.__contains__)
        self.stats = store.stats
        kv.host.external_holders = self.holders
        self._closed = False
        # KV cache events (engine.kv_events.TierHook; None: off): told of each block queued
        # for writing. Blocks the store evicts later are not announced (its writer thread
        # drops whole segments).
        self.events = None
        # Tensor parallelism: the other ranks' stores (engine.distributed.kv_tiers), or None
        self.shards = None
        self.on_evict_policy = store.config.write_policy == "on-evict"
        if self.on_evict_policy:
            kv.host.cache.evict_listener = self._on_host_evict
            kv.host.cache.drop_listener = self._on_spill_dropped

    # ---- arrival and prefetch -----------------------------------------------------------
    def on_arrival(self, seq, token_ids: Sequence[int], extra_keys: tuple) -> int:
        """Start loading the disk blocks of this prompt that neither the device nor the host
        holds (at most half of the free host blocks: the others' share); returns how many
        blocks were queued for reading. The prompt's hashes are kept for the admission gate,
        which looks again (``ready``)."""
        kv = self.kv
        seq_id = seq.seq_id
        if not kv.enable_prefix_caching or seq_id in self._jobs:
            return 0
        chains = kv.prompt_chains(token_ids, extra_keys)
        self._prompts[seq_id] = _Prompt(seq, chains)
        return self._stage(seq_id, chains, at_gate=False)[0]

    def _plan(self, chains: tuple, budget: int | None = None) -> ReadPlan:
        """What to read (``engine.kv_cache.disk.plan``); ``budget``: at most this many blocks
        (one group: the chain's first ones are as useful as all of them, up to their end)."""
        if len(self._groups) > 1:
            if hasattr(self.store, "probe"):  # a remote store: one round trip, then `in`
                self.store.probe([h for chain in chains for h in chain])
            return plan_groups(self.kv, chains, self.store, budget)
        plan = plan_chain(self.kv, chains[0], self.store)
        if budget is not None:
            plan = replace(plan, to_read=plan.to_read[:budget], positions=plan.positions[:budget])
        return plan

    def _stage(self, seq_id: str, chains: tuple, at_gate: bool,
               busy: bool = True) -> tuple[int, int]:
        """Look the prompt's ``chains`` up device -> host -> disk (``_plan``) and queue a read
        of the blocks only the disk holds into host blocks; returns (blocks queued, blocks the
        disk has there). On arrival it takes at most half of the free host blocks and counts
        the misses; at the gate, every free host block but its own free host hits (after the
        requests behind it gave up theirs; with nothing else to run, once their reads in
        flight have landed)."""
        host = self.kv.host
        plan = self._plan(chains)
        in_host, found = plan.in_host, len(plan.to_read)
        if not at_gate:
            self.stats.miss_blocks += plan.misses
        if not found:
            return 0, 0
        free = host.pool.num_free_blocks
        # at the gate, spare its own host hits that are free (those its reads filled are
        # held, off the free queue) from the allocation's LRU eviction
        own_free = max(0, in_host - len(self._held.get(seq_id, ())))
        if at_gate and free - own_free < found:
            # the head of the queue goes first: requests behind it give up their read blocks
            # (still cached: their own gate finds them, or reads them again); with nothing
            # else to run, their reads in flight are waited for (local reads: milliseconds)
            if not busy:
                for job in list(self._jobs.values()):
                    job.done.wait(_GATE_WAIT_S)
                self.poll()
            for other in [s for s in self._held if s != seq_id]:
                self._release(other)
            free = host.pool.num_free_blocks
        n = min(found, free - own_free if at_gate else free // 2)
        if n <= 0:
            return 0, found
        if n < found:  # a shorter hit whose reads fit
            plan = self._plan(chains, budget=n)
            n = len(plan.to_read)
            if n == 0:
                return 0, found
        if self._settle_host is not None:
            self._settle_host()
        blocks = host.pool.get_new_blocks(n)  # one reference each, held by the job
        job = PrefetchJob(seq_id, plan.to_read, blocks, plan.positions)
        self._jobs[seq_id] = job
        self._prefetcher.submit(job)
        if self.shards is not None:  # every rank reads its share into the same host blocks
            self.shards.read(job)
        return n, found

    def _write_host_block(self, host_block: int, payload: bytes) -> None:
        """Reader thread: the payload's bytes into the host block it reserved."""
        src = np.frombuffer(payload, dtype=np.uint8)
        off = 0
        for dst, width in zip(self._host, self._host_widths):
            dst[host_block] = src[off:off + width]
            off += width

    def poll(self) -> None:
        """Hand finished reads to the host prefix cache (see the class docstring); release
        the blocks held for requests that left the queue."""
        pool = self.kv.host.pool
        done = self._prefetcher.take_done()
        if self.shards is not None and done:
            # a block is read only if every rank read and verified its share (they load the
            # same blocks); this also waits for the other ranks' reads to finish
            for job, n in zip(done, self.shards.agree(done)):
                job.num_loaded = min(job.num_loaded, n)
        for job in done:
            if self._jobs.get(job.seq_id) is job:
                del self._jobs[job.seq_id]
            kept, unused, places = [], [], set()
            for j, (h, hb) in enumerate(zip(job.hashes, job.host_blocks)):
                if j < job.num_loaded and pool.register(hb, h):
                    self.stats.hit_blocks += 1
                    self.stats.prefetched_blocks += 1
                    kept.append(hb)
                    places.add(job.positions[j])
                else:
                    unused.append(hb)
            # prompt tokens: a hybrid cache's groups read pages of the same tokens
            self.stats.hit_tokens += len(places) * self.block_size
            for hb in reversed(unused):
                pool.free(hb)
            if kept:
                self._held.setdefault(job.seq_id, []).extend(kept)
        for seq_id in [s for s in self._held if not self._still_waiting(s)]:
            self._release(seq_id)

    def _still_waiting(self, seq_id: str) -> bool:
        prompt = self._prompts.get(seq_id)
        return prompt is not None and prompt.seq.status is SeqStatus.WAITING

    def _release(self, seq_id: str) -> None:
        """Drop the references held on ``seq_id``'s read blocks: they stay in the host cache
        as free-cached blocks, the head of its chain most recently used."""
        pool = self.kv.host.pool
        for hb in reversed(self._held.pop(seq_id, [])):
            pool.free(hb)

    def ready(self, seq, busy: bool) -> bool:
        """The admission gate: may ``seq`` be admitted now? (class docstring)"""
        while True:
            job = self._jobs.get(seq.seq_id)
            if job is not None and job.done.is_set():
                self.poll()  # its blocks are in the host cache now; look for the rest
                job = None
            if job is None:
                # Look again: blocks the device or host held on arrival may have been evicted
                # since (other requests ran), and the staging area may have room now.
                prompt = self._prompts.get(seq.seq_id)
                if prompt is None or prompt.lookups_left <= 0:
                    return True
                prompt.lookups_left -= 1
                queued, found = self._stage(seq.seq_id, prompt.chains, at_gate=True, busy=busy)
                if not queued:
                    # the disk has blocks but no host block is free: while others run, wait
                    # a step (blocks held for requests admitted this step are released next)
                    return not (found and busy and prompt.lookups_left > 0)
                job = self._jobs[seq.seq_id]
            pending = len(job.hashes) - job.num_loaded
            # a record holds block_size tokens of one group's layers: of every layer's with
            # one group, a share of them in a hybrid cache
            tokens = pending * self.block_size / len(self._groups)
            if self.cost is not None and pending * self.block_bytes / _DISK_BYTES_PER_S > \
                    tokens * self.cost.seconds_per_token:
                return True  # recomputing is cheaper than waiting for the disk
            if busy:
                return False
            # nothing else to run: wait for the reads, then look for the rest
            if not job.done.wait(_GATE_WAIT_S):
                return True

    def holders(self) -> dict[int, int]:
        """Host block id -> references held by reads in flight and by read blocks kept for
        waiting requests (for integrity checks)."""
        out: dict[int, int] = {}
        blocks = [hb for job in self._jobs.values() for hb in job.host_blocks]
        for hb in blocks + [hb for held in self._held.values() for hb in held]:
            out[hb.block_id] = out.get(hb.block_id, 0) + 1
        return out

    def forget(self, seq_id: str) -> None:
        for g, _ in self._groups:
            self._written.pop(group_key(seq_id, g), None)
        self._prompts.pop(seq_id, None)
        self._release(seq_id)

    # ---- writes -----------------------------------------------------------------------------
    def after_step(self, seq_ids: Sequence[str]) -> int:
        """Queue the blocks ``seq_ids`` committed since the last call (``write-through``;
        nothing under ``on-evict``); returns how many."""
        if self.on_evict_policy:
            return 0
        todo: list[tuple[int, bytes]] = []
        for seq_id in seq_ids:
            for g, m in self._groups:
                todo += self._newly_committed(m, group_key(seq_id, g))
        return self._submit_device(todo)

    def _newly_committed(self, m, key: str) -> list[tuple[int, bytes]]:
        """``(block id, hash)`` of the blocks table ``key`` of manager ``m`` committed since
        the last call that the disk lacks; marks them considered."""
        n = m.num_committed_blocks(key)
        w = self._written.get(key, 0)
        self._written[key] = n  # below w: rolled back or recomputed from scratch
        pool = self.kv.pool
        table, names, out = m.block_table(key), None, []
        for i in range(w, n):
            if table[i] >= 0:
                b, h = table[i], pool.blocks[table[i]].block_hash
            else:  # released behind a window this step: still named in the cache
                names = m.block_hashes(key) if names is None else names
                held = pool.cached.get(names[i]) if i < len(names) else None
                if held is None:
                    continue
                b, h = held.block_id, names[i]
            if h is not None and self._wanted(h):
                out.append((b, h))
        return out

    def _on_disk(self, h: bytes) -> bool:
        """Held by the store, or queued for it lately."""
        return h in self._recent or self._stored(h)

    def _wanted(self, h: bytes) -> bool:
        """Whether a store may lack ``h``: this one's, or under tensor parallelism any rank's
        (each rank skips what its own store holds: a rank that lost its share writes it
        again, so the block becomes a hit again)."""
        return self.shards is not None or not self._on_disk(h)

    def _submit(self, h: bytes, payload: bytes) -> bool:
        if len(self._recent) > 65536:
            self._recent.clear()
        if self.store.submit(h, payload):
            self._recent.add(h)
            if self.events is not None:
                self.events.stored(h)
            return True
        return False

    def _submit_device(self, todo: list[tuple[int, bytes]]) -> int:
        """Queue device blocks ``(block id, hash)``; returns how many were queued."""
        if self.shards is not None and todo:
            self.shards.write("device", todo)
            todo = [(b, h) for b, h in todo if not self._on_disk(h)]
        if not todo or not self.store.writable:
            return 0
        ids = torch.tensor([b for b, _ in todo], dtype=torch.int64,
                           device=self._device[0].device)
        gathered = torch.cat([_flat_bytes(t.index_select(0, ids)) for t in self._device],
                             dim=1).cpu().numpy()
        return sum(self._submit(h, row.tobytes()) for row, (_, h) in zip(gathered, todo))

    def _host_payload(self, host_block: int) -> bytes:
        return b"".join(h[host_block].tobytes() for h in self._host)

    def _submit_host(self, todo: list[tuple[int, bytes]]) -> int:
        """Queue host blocks ``(block id, hash)``; returns how many were queued."""
        if self.shards is not None and todo:
            self.shards.write("host", todo)
        return sum(self._submit(h, self._host_payload(b)) for b, h in todo
                   if not self._on_disk(h))

    def _flush(self) -> None:
        """Wait for every rank's queued writes."""
        self.store.flush()
        if self.shards is not None:
            self.shards.flush()

    # ---- on-evict ---------------------------------------------------------------------------
    def _on_host_evict(self, host_block: int, block_hash: bytes) -> None:
        """``on-evict``: a named host block is about to be reused: its bytes go to the disk
        (dropped when the writer's queue is full, as every write)."""
        if not (self.store.writable or self.shards is not None) or not self._wanted(block_hash):
            return
        if self._settle_host is not None:
            self._settle_host()  # a spill into this block may still be in flight
        self._submit_host([(host_block, block_hash)])

    def _on_spill_dropped(self, device_block: int, block_hash: bytes) -> None:
        """``on-evict``: a named device block leaves memory without a host copy (every host
        block in use): its bytes go to the disk straight from the device pools."""
        if self._wanted(block_hash):
            self._submit_device([(device_block, block_hash)])

    def _write_back_memory(self) -> int:
        """``on-evict`` at a clean shutdown: every named block of the host and device pools
        that the disk lacks, the writer drained between batches so that none is dropped for
        a full queue. Returns the blocks queued."""
        if self._settle_host is not None:
            self._settle_host()
        batch = max(1, self.store.config.queue_blocks // 2)
        queued = 0
        host = [(b.block_id, h) for h, b in list(self.kv.host.pool.cached.items())
                if self._wanted(h)]
        for k in range(0, len(host), batch):
            queued += self._submit_host(host[k:k + batch])
            self._flush()
        device = [(b.block_id, h) for h, b in list(self.kv.pool.cached.items())
                  if self._wanted(h)]
        for k in range(0, len(device), batch):
            queued += self._submit_device(device[k:k + batch])
            self._flush()
        return queued

    def snapshot(self) -> DiskTierStats:
        return self.store.snapshot()

    def tier_state(self) -> TierState:
        """The disk as a tier of the KV page (``engine.kv_cache.snapshot.TierState``): its
        capacity in blocks (``--kv-disk-size`` over one record's bytes), the blocks this server's
        index can find as cached-and-evictable, the blocks being read ahead into host memory as
        used, the rest free."""
        s = self.store
        stored = len(s)
        loading = min(stored, sum(len(job.hashes) - job.num_loaded
                                  for job in self._jobs.values()))
        capacity = max(stored, s.config.size_bytes // (self.block_bytes + RECORD_HEADER_BYTES))
        cached_free = max(0, stored - loading)
        return TierState(name=getattr(s, "tier_name", "disk"), num_blocks=capacity, free=capacity - stored,
                         cached_free=cached_free, used=stored - cached_free, cached=stored)

    # ---- clearing (EngineCore.reset_prefix_cache) -----------------------------------------
    def _parts(self) -> dict:
        """The stores under the host tier by tier name: "disk", "remote" or both."""
        s = self.store
        if not hasattr(s, "remote"):  # a DiskStore
            return {"disk": s}
        return {**({"disk": s.disk} if s.disk is not None else {}), "remote": s.remote}

    def tier_names(self) -> list[str]:
        return list(self._parts())

    def clear(self, tiers) -> dict[str, int | None]:
        """Drop every block the stores of ``tiers`` (names from :meth:`tier_names`) hold for
        this model: each store's ``clear()``, which must not wait long (the engine thread runs
        it between two steps); a store without one is reported as None (not cleared). Returns
        the blocks dropped per tier. Reads in flight for waiting requests may still land in
        host memory (those requests hold them)."""
        parts = self._parts()
        out: dict[str, int | None] = {}
        for name in tiers:
            clear = getattr(parts[name], "clear", None)
            out[name] = clear() if clear is not None else None
        if self.shards is not None:  # the other ranks' shares of the same tiers
            self.shards.clear(list(tiers))
        self._recent.clear()  # blocks queued lately were dropped with the queue
        return out

    def remote_snapshot(self):
        """The remote store's ``RemoteTierStats``, or None without one."""
        f = getattr(self.store, "remote_snapshot", None)
        return f() if f is not None else None

    def describe(self) -> str:
        s = self.store
        remote = s.describe_remote() if hasattr(s, "describe_remote") else ""
        if getattr(s, "disk", s) is None:  # the remote store alone
            return remote
        groups = len(self._groups)  # a block of tokens is one record per KV group
        pages = f", one per KV group and {self.block_size} tokens" if groups > 1 else ""
        down = "" if s.writable else f" | not writing ({s.health.reason}), retrying"
        return (f"disk KV tier: {s.dir} | {s.config.size_bytes / 2**30:.2f} GiB for the "
                f"directory | {len(s)} blocks found{pages} "
                f"({len(s) * self.block_size // groups} tokens) | "
                f"{self.block_bytes} bytes/block{down}" + (f"; {remote}" if remote else ""))

    def close(self) -> None:
        """Stop the threads; under ``on-evict`` the blocks in memory are written first, then
        the queued writes. Idempotent."""
        if self.on_evict_policy and not self._closed:
            try:
                n = self._write_back_memory()
                logger.info("kv disk tier: %d blocks written back from memory at shutdown", n)
            except Exception:  # noqa: BLE001 - a failed write-back must not block the shutdown
                logger.exception("kv disk tier: writing the memory's blocks back failed")
        self._closed = True
        self._prefetcher.close()
        try:
            self.store.close()
        finally:
            if self.shards is not None:  # the other ranks' writes land before they stop
                self.shards.close()
