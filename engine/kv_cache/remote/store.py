"""RemoteStore: one fingerprint's blocks in a Redis/Valkey server, shared by every server using
it (replicas on other hosts included), with the disk store's interface
(``engine.kv_cache.disk.store.DiskStore``: ``lookup``, ``read``, ``submit``, ``flush``,
``close``, ``snapshot``, ``writable``, ``in``) so that ``DiskTier`` drives it unchanged.

Keys ``{prefix}:{fingerprint hex}:{block hash hex}``, values the disk tier's checksummed record;
the server's ``maxmemory-policy`` evicts. Look-ups are one pipelined round trip on the engine
thread, bounded by ``timeout_s``; reads and writes run on their own threads; a failed command
marks the store down (``.health``) and nothing is sent until a ping answers. The full contract
is on :class:`RemoteStore`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from engine.config.kv_remote import RemoteTierConfig
from engine.kv_cache.disk.health import OK, RetryPolicy
from engine.kv_cache.disk.queued_writes import QueuedWrites
from engine.kv_cache.remote.client import CLIENT_ERRORS, RemoteClient
from engine.kv_cache.remote.health import RemoteHealth
from engine.kv_cache.remote.record import BadRecord, decode_value, encode_value
from engine.kv_cache.remote.stats import RemoteTierStats

logger = logging.getLogger("kvserve.engine")
_STOP = object()
_WAKE = (None, None)  # no block, no flush: the writer looks at the tier's health
KNOWN_CAP = 1 << 16


class RemoteStore(QueuedWrites):
    """Contract:

    * Keys: ``{prefix}:{fingerprint hex}:{block hash hex}`` (``kvserve:`` by default); values:
      the disk tier's checksummed record behind its fingerprint header (``.record``). Nothing
      else is written; the server's ``maxmemory-policy`` (``allkeys-lru``) evicts, and an
      evicted block is a miss like any other.
    * ``lookup(chain)``: one pipelined ``EXISTS`` per block, one round trip, on the caller's
      (engine) thread, bounded by ``timeout_s``; the leading run found is the answer.
    * ``read`` / ``read_many``: ``MGET`` (the reader thread), bounded by ``io_timeout_s``; a
      value that fails its checks is never returned: logged, counted, deleted (best effort), a
      miss.
    * ``submit(hash, payload)`` queues a write and never blocks: with the queue full, or the
      store down, the block is dropped and counted. One writer thread encodes and ``SET``s in
      pipelined batches.
    * A command that fails (refused, timed out, an error answer) marks the store down
      (``.health``: one WARNING per outage): while down nothing is sent, look-ups and reads are
      misses, writes are dropped; the writer thread pings after 1 s doubling to 60 s and the
      store resumes when the server answers.
    * ``clear()`` (``POST /reset_prefix_cache``, every tier or ``?tier=remote``) deletes every
      key of this fingerprint (``SCAN`` + ``UNLINK``): the shared cache, for every replica.
    * ``in`` / ``len`` answer from what this server knows (blocks it wrote or found, at most
      ``KNOWN_CAP``, the oldest forgotten first), never with a round trip: ``DiskTier`` asks per
      committed block whether to write it.
    """

    def __init__(self, config: RemoteTierConfig, fingerprint: bytes, fingerprint_hex: str,
                 block_bytes: int, retry: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Never raises for the server's sake: one that does not answer starts the store
        down, retried (class docstring)."""
        self.config = config
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.prefix = f"{config.key_prefix}:{fingerprint_hex}:"
        self.where = config.redacted_url()
        self.health = RemoteHealth(self.where, retry, clock)
        self.stats = RemoteTierStats(enabled=True, available=True)
        # the engine thread's look-ups wait at most timeout_s; reads and writes io_timeout_s
        self._fast = RemoteClient(config.url, config.timeout_s, config.timeout_s)
        self._io = RemoteClient(config.url, config.io_timeout_s, config.timeout_s)
        self._known: dict[bytes, None] = {}  # insertion-ordered set, oldest first
        self._lock = threading.Lock()
        try:
            self._fast.ping()
        except CLIENT_ERRORS as exc:
            self._failed("connecting", exc)
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_blocks)
        self._thread = threading.Thread(target=self._write_loop, name="kv-remote-writer",
                                        daemon=True)
        self._thread.start()

    def key(self, block_hash: bytes) -> bytes:
        return (self.prefix + block_hash.hex()).encode()

    # ---- what this server knows the store holds ---------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._known

    def __len__(self) -> int:
        return len(self._known)

    def _know(self, block_hash: bytes, present: bool) -> None:
        with self._lock:
            if not present:
                self._known.pop(block_hash, None)
                return
            self._known[block_hash] = None
            if len(self._known) > KNOWN_CAP:
                del self._known[next(iter(self._known))]

    @property
    def writable(self) -> bool:
        return self.health.available

    # ---- failures ---------------------------------------------------------------------
    def _failed(self, what: str, exc: BaseException) -> None:
        self.health.failed(what, exc)
        self._sync_health()
        if threading.current_thread() is not getattr(self, "_thread", None):
            try:  # wake the writer, which may wait for work without a deadline, to retry
                self._queue.put_nowait(_WAKE)
            except (queue.Full, AttributeError):  # busy (it will look), or not started yet
                pass

    def _sync_health(self) -> None:
        h = self.health
        self.stats.available, self.stats.errors, self.stats.outages = (
            h.available, h.errors, h.outages)

    def _ok(self) -> None:
        """A command succeeded: ends a probation (cheap otherwise)."""
        if self.health.state != OK:
            self.health.succeeded()
            self._sync_health()

    # ---- look-ups and reads -----------------------------------------------------------
    def lookup(self, hashes) -> int:
        """How many leading ``hashes`` the store holds (0 while it is down)."""
        hashes = list(hashes)
        if not hashes:
            return 0
        if not self.health.available:
            self.stats.miss_blocks += len(hashes)
            return 0
        try:
            found = self._fast.exists_each([self.key(h) for h in hashes])
        except CLIENT_ERRORS as exc:
            self._failed("looking blocks up", exc)
            return 0
        self._ok()
        for h, present in zip(hashes, found):
            self._know(h, present)
        n = found.index(False) if False in found else len(found)
        self.stats.lookups += 1
        self.stats.miss_blocks += len(hashes) - n
        return n

    def probe(self, hashes) -> None:
        """Learn which of ``hashes`` (any order) the store holds, for ``in`` (a hybrid KV
        cache's read plan asks block by block)."""
        todo = [h for h in hashes if h not in self._known]
        if not todo or not self.health.available:
            return
        try:
            found = self._fast.exists_each([self.key(h) for h in todo])
        except CLIENT_ERRORS as exc:
            self._failed("looking blocks up", exc)
            return
        self._ok()
        self.stats.lookups += 1
        for h, present in zip(todo, found):
            self._know(h, present)

    def read(self, block_hash: bytes) -> bytes | None:
        """Verified payload of ``block_hash``, or None (not held, evicted, bad, or down)."""
        return self.read_many([block_hash])[0]

    def read_many(self, hashes: list[bytes]) -> list[bytes | None]:
        """Verified payloads in order (one ``MGET``), None where a block is missing or bad."""
        if not hashes:
            return []
        if not self.health.available:
            return [None] * len(hashes)
        keys = [self.key(h) for h in hashes]
        t0 = time.perf_counter()
        try:
            values = self._io.mget(keys)
        except CLIENT_ERRORS as exc:
            self._failed("reading blocks", exc)
            return [None] * len(hashes)
        self._ok()
        out: list[bytes | None] = []
        bad: list[bytes] = []
        for h, key, value in zip(hashes, keys, values):
            payload = None
            if value is None:
                self.stats.miss_blocks += 1  # evicted since it was found
            else:
                try:
                    payload = decode_value(value, self.fingerprint, h, self.block_bytes)
                except BadRecord as exc:
                    logger.warning("kv remote tier: block %s at %s is bad (%s): not used, "
                                   "deleted, recomputed instead", h.hex()[:16], self.where, exc)
                    self.stats.bad_records += 1
                    bad.append(key)
            self._know(h, payload is not None)
            if payload is not None:
                self.stats.hit_blocks += 1
                self.stats.read_bytes += len(value)
            out.append(payload)
        self.stats.read_seconds += time.perf_counter() - t0
        if bad:
            try:
                self._io.delete(bad)
            except CLIENT_ERRORS as exc:
                self._failed("deleting bad blocks", exc)
        return out

    # ---- writes (any thread queues, the writer thread writes) -----------------------
    # submit() and flush(): QueuedWrites (engine/kv_cache/disk/queued_writes.py)

    def clear(self) -> int | None:
        """Drop this fingerprint's blocks: the queued writes, what this server knows, and
        every key under :attr:`prefix` in the server (``SCAN`` + ``UNLINK``, batches of 1,000,
        each command bounded by ``io_timeout_s``): the blocks every replica sharing the store
        wrote for this model, since they are one cache. Returns the keys deleted; None when the
        store is down or a command failed (then nothing more is tried: not cleared). A batch
        the writer is sending at that moment may still land."""
        kept = []  # flush markers and the stop item stay queued; blocks go
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item[0] is None or item[0] is _STOP:
                kept.append(item)
        for item in kept:
            self._queue.put_nowait(item)
        with self._lock:
            self._known.clear()
        if not self.health.available:
            return None
        n = 0
        try:
            batch: list[bytes] = []
            for key in self._io.redis.scan_iter(match=self.prefix.encode() + b"*", count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    self._io.delete(batch)
                    n, batch = n + len(batch), []
            self._io.delete(batch)
            n += len(batch)
        except CLIENT_ERRORS as exc:
            self._failed("clearing blocks", exc)
            return None
        self._ok()
        return n

    def close(self) -> None:
        """Write what is queued (while the server answers), stop the writer. Idempotent."""
        if self._thread.is_alive():
            self._queue.put((_STOP, None))
            self._thread.join(timeout=60)
        self._fast.close()
        self._io.close()

    def _wait_s(self) -> float | None:
        if self.health.available:
            return None
        return min(max(self.health.seconds_to_retry(), 0.05), self.health.policy.max_s)

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._wait_s())
            except queue.Empty:
                item = None
            if self.health.retry_due():
                self._retry()
            if item is None:
                continue
            batch = []  # blocks: (hash, payload); take more while they are queued
            while item is not None and item[0] is not None and item[0] is not _STOP:
                batch.append(item)
                item = None
                if len(batch) < self.config.write_batch:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        pass
            if batch:
                try:
                    self._write(batch)
                except Exception:  # noqa: BLE001 - the writer must outlive any one batch
                    logger.exception("kv remote tier: writing blocks failed")
            if item is None:
                continue
            if item[0] is _STOP:
                return
            if item[1] is not None:
                item[1].set()  # a flush marker: every block queued before it was attempted

    def _retry(self) -> None:
        try:
            self._fast.ping()
        except CLIENT_ERRORS as exc:
            self._failed("retrying", exc)
            return
        self.health.usable()
        self._sync_health()

    def _write(self, batch: list[tuple[bytes, bytes]]) -> None:
        if not self.health.available:
            self.stats.dropped_writes += len(batch)
            return
        t0 = time.perf_counter()
        items = [(self.key(h), encode_value(self.fingerprint, h, p)) for h, p in batch]
        try:
            self._io.set_many(items)
        except CLIENT_ERRORS as exc:
            self.stats.dropped_writes += len(batch)
            self._failed("writing blocks", exc)
            return
        self._ok()
        for h, _ in batch:
            self._know(h, True)
        self.stats.written_blocks += len(batch)
        self.stats.write_bytes += sum(len(v) for _, v in items)
        self.stats.write_seconds += time.perf_counter() - t0

    def snapshot(self) -> RemoteTierStats:
        s = RemoteTierStats(**vars(self.stats))
        s.known_blocks = len(self._known)
        s.available = self.health.available
        return s

    def describe(self) -> str:
        down = "" if self.health.available else f" | down ({self.health.reason}), retrying"
        return (f"remote KV tier: {self.where} | keys {self.prefix}* | timeouts "
                f"{self.config.timeout_s:g} s (look-ups), {self.config.io_timeout_s:g} s "
                f"(reads, writes) | {self.block_bytes} bytes/block{down}")
