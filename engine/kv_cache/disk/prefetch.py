"""The reader thread: disk records into host blocks, off the engine thread.

``submit(job)`` queues a :class:`PrefetchJob` (a sequence's disk blocks, each with a host block
the engine thread reserved). The thread reads each record (verified by the store), copies it
into its host block and stops at the first miss: a chain is only useful up to its first gap.
With ``read_many`` (a store behind a network: ``engine.kv_cache.remote``) the records are
fetched ``READ_BATCH`` at a time, one round trip each.
Finished jobs are collected by the engine thread with :meth:`Prefetcher.take_done`, which alone
touches the host pool's bookkeeping (the thread writes only the reserved blocks' bytes).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("kvserve.engine")

WriteBlock = Callable[[int, bytes], None]  # (host block id, payload) -> None
READ_BATCH = 16  # records per read_many call


@dataclass
class PrefetchJob:
    seq_id: str
    hashes: list[bytes]
    host_blocks: list  # KVBlock of the host pool, one reference each held by the job
    positions: list[int] = field(default_factory=list)  # chain place of each (ReadPlan's)
    num_loaded: int = 0  # leading blocks read, verified and copied
    done: threading.Event = field(default_factory=threading.Event)


class Prefetcher:
    def __init__(self, read: Callable[[bytes], bytes | None], write_block: WriteBlock,
                 read_many: Callable[[list[bytes]], list[bytes | None]] | None = None) -> None:
        self._read = read
        self._read_many = read_many
        self._write_block = write_block
        self._queue: queue.Queue = queue.Queue()
        self._done: list[PrefetchJob] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kv-disk-reader", daemon=True)
        self._thread.start()

    def submit(self, job: PrefetchJob) -> None:
        self._queue.put(job)

    def take_done(self) -> list[PrefetchJob]:
        """Jobs finished since the last call (engine thread)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _payloads(self, hashes: list[bytes]):
        """Each hash's verified payload or None, read lazily (the loop stops at a miss)."""
        if self._read_many is None:
            for h in hashes:
                yield self._read(h)
            return
        for k in range(0, len(hashes), READ_BATCH):
            yield from self._read_many(hashes[k:k + READ_BATCH])

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                for payload, hb in zip(self._payloads(job.hashes), job.host_blocks):
                    if payload is None:
                        break
                    self._write_block(hb.block_id, payload)
                    job.num_loaded += 1
            except Exception:  # noqa: BLE001 - a failed read is a miss, never a crash
                logger.exception("kv disk tier: prefetch for %s failed", job.seq_id)
            with self._lock:
                self._done.append(job)
            job.done.set()
