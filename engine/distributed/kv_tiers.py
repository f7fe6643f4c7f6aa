"""The disk and remote KV tiers under tensor parallelism: every rank stores its own share.

Each rank's pools hold its own KV heads, so a block is N shares, each in a store of its own
rank (the same ``DiskStore`` / ``ChainStore``, under a fingerprint naming the rank:
``KVFingerprint.tp_rank``). Rank 0's ``DiskTier`` decides everything and the workers do their
share's I/O, driven by orders on the control group (run by ``engine.distributed.worker`` in
order with the step plans): ``("kv_read", job id, hashes, host block ids)`` (the same read into
the same host blocks of each rank's pools, on its own reader thread); ``("kv_agree", job ids)``
(every rank waits for its own reads, then one all-reduce takes the minimum of the leading
blocks each read and verified: a block is a hit only when every share is present and good, so
every rank loads the same blocks); ``("kv_write", "device" | "host", [(block id, hash)])``
(each rank copies its share out at once and skips what its store holds);
``("kv_flush",)``, ``("kv_clear", tiers)``, ``("kv_close",)`` (flush and close end with an
all-reduce: when rank 0 goes on, every write has landed).
Counters and ``/metrics`` are rank 0's store's (its share of each block)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache.disk.build import build_store, device_pools, rank_fingerprint
from engine.kv_cache.disk.prefetch import Prefetcher, PrefetchJob

logger = logging.getLogger("kvserve.distributed")
_RECENT_CAP = 65536


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([blocks, ...]) as uint8 [blocks, bytes per block]."""
    return t.view(torch.uint8).reshape(t.shape[0], -1)


class StoredTierShards:
    """Rank 0's side: the ``DiskTier``'s ``shards`` (the orders above)."""

    def __init__(self, runner) -> None:
        """``runner``: rank 0's ``TensorParallelRunner`` (its ``tier_order``)."""
        self._runner = runner
        self._serial = 0
        self._ids: dict[int, int] = {}  # id(PrefetchJob) -> its job id on the workers

    def read(self, job: PrefetchJob) -> None:
        self._serial += 1
        self._ids[id(job)] = self._serial
        self._runner.tier_order(("kv_read", self._serial, list(job.hashes),
                                 [hb.block_id for hb in job.host_blocks]))

    def agree(self, jobs: list[PrefetchJob]) -> list[int]:
        """For each finished job of rank 0, the leading blocks every rank read and verified."""
        ids = [self._ids.pop(id(job)) for job in jobs]
        return self._runner.tier_order(("kv_agree", ids),
                                       counts=[job.num_loaded for job in jobs])

    def write(self, source: str, blocks: list[tuple[int, bytes]]) -> None:
        self._runner.tier_order(("kv_write", source, list(blocks)))

    def flush(self) -> None:
        self._runner.tier_order(("kv_flush",), barrier=True)

    def clear(self, tiers: list[str]) -> None:
        self._runner.tier_order(("kv_clear", tiers))

    def close(self) -> None:
        """At shutdown: the workers' queued writes land first. A group already broken (a worker
        died) is logged, not raised: the shutdown goes on."""
        try:
            self._runner.tier_order(("kv_close",), barrier=True)
        except Exception as exc:  # noqa: BLE001 - the engine is closing either way
            logger.warning("kv tiers: closing the other ranks' stores failed: %s", exc)


@dataclass
class _HostBlock:
    block_id: int


class RankStores:
    """A worker's side: its own store (its share, under its rank's fingerprint), its own
    reader thread into its host pools, and the orders above."""

    def __init__(self, config, runner, files_path, hf_config) -> None:
        self._runner = runner
        fp = rank_fingerprint(config, runner, files_path, hf_config, tp_rank=runner.tp.rank)
        self.store = build_store(config, runner, fp)
        self._device = [t for kv in device_pools(runner) for t in kv]
        self._host = [_flat_bytes(t).numpy() for kv in runner.host_kv_caches for t in kv]
        self._widths = [h.shape[1] for h in self._host]
        if sum(self._widths) != self.store.block_bytes:
            raise ValueError(f"rank {runner.tp.rank}: stored blocks of "
                             f"{self.store.block_bytes} bytes for pools of {sum(self._widths)}")
        self._stored = getattr(self.store, "stored_everywhere", self.store.__contains__)
        self._recent: set[bytes] = set()
        self._jobs: dict[int, PrefetchJob] = {}
        self._prefetcher = Prefetcher(self.store.read, self._write_host_block,
                                      getattr(self.store, "read_many", None))
        self._closed = False
        logger.info("rank %d: stored KV tier share %s (%d blocks found)", runner.tp.rank,
                    getattr(self.store, "dir", "?"), len(self.store))

    def handle(self, order: tuple) -> None:
        kind = order[0]
        if kind == "kv_read":
            _, job_id, hashes, host_blocks = order
            self._runner.wait_host_copies()  # a deferred spill into these blocks lands first
            job = PrefetchJob(str(job_id), hashes, [_HostBlock(b) for b in host_blocks])
            self._jobs[job_id] = job
            self._prefetcher.submit(job)
        elif kind == "kv_agree":
            counts = []
            for job_id in order[1]:
                job = self._jobs.pop(job_id)
                job.done.wait()
                counts.append(job.num_loaded)
            self._prefetcher.take_done()
            self._runner.tp.min_ints(counts)
        elif kind == "kv_write":
            self._write(order[1], order[2])
        elif kind == "kv_flush":
            self.store.flush()
            self._runner.tp.ping()
        elif kind == "kv_clear":
            self._clear(order[1])
        elif kind == "kv_close":
            self.close()
            self._runner.tp.ping()
        else:
            raise RuntimeError(f"unknown order {kind!r} from rank 0")

    def _write_host_block(self, host_block: int, payload: bytes) -> None:
        """Reader thread: the payload's bytes into the host block rank 0 reserved."""
        src = np.frombuffer(payload, dtype=np.uint8)
        off = 0
        for dst, width in zip(self._host, self._widths):
            dst[host_block] = src[off:off + width]
            off += width

    def _write(self, source: str, blocks: list[tuple[int, bytes]]) -> None:
        todo = [(b, h) for b, h in blocks if h not in self._recent and not self._stored(h)]
        if not todo or not self.store.writable:
            return
        if source == "device":
            ids = torch.tensor([b for b, _ in todo], dtype=torch.int64,
                               device=self._device[0].device)
            rows = torch.cat([_flat_bytes(t.index_select(0, ids)) for t in self._device],
                             dim=1).cpu().numpy()
            payloads = [row.tobytes() for row in rows]
        else:
            self._runner.wait_host_copies()
            payloads = [b"".join(h[b].tobytes() for h in self._host) for b, _ in todo]
        if len(self._recent) > _RECENT_CAP:
            self._recent.clear()
        for (_, h), payload in zip(todo, payloads):
            if self.store.submit(h, payload):
                self._recent.add(h)

    def _clear(self, tiers: list[str]) -> None:
        s = self.store
        parts = ({"disk": s} if not hasattr(s, "remote") else
                 {**({"disk": s.disk} if s.disk is not None else {}), "remote": s.remote})
        for name in tiers:
            clear = getattr(parts.get(name), "clear", None)
            if clear is not None:
                clear()
        self._recent.clear()

    def close(self) -> None:
        """Stop the reader, write what is queued, close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._prefetcher.close()
        self.store.close()
