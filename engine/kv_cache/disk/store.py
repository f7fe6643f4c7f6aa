"""DiskStore: one fingerprint's segment files under ``DIR/kv-<fingerprint>/``.

Contract:

* Start-up: the directory is created if needed and proven writable (``ValueError`` naming it
  otherwise); the index (block hash -> record) is rebuilt from the segments themselves, helped
  by ``manifest.json`` (written at close) only for segments whose size it states exactly. A
  segment whose header is not this fingerprint's is ignored; a torn tail ends its segment.
* ``submit(hash, payload)`` queues a write and never blocks: with the queue full, or after the
  disk filled up, the block is dropped and counted. One writer thread appends records to this
  server's active segment (created exclusively, held under ``flock``) and starts a new one
  past ``segment_bytes``; other servers' segments are never written (one writer per segment).
* ``read(hash)`` returns verified payload bytes or None; a record failing its checks is logged,
  counted and removed from the index (never returned).
* LRU eviction by whole segments (a read refreshes its segment) keeps the directory's segments
  under ``size_bytes``; a segment another writer holds is skipped; an ``evict.lock`` ``flock``
  keeps two servers from evicting at once. Segments other servers add or delete are picked up
  by :meth:`refresh` (called by look-ups at most once a second, and before evicting).
* Disk full (ENOSPC, EDQUOT, EFBIG): the partial record is cut off, the tier stops writing and
  says so once in the log and in ``stats().disk_full``; reads go on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.kv_cache.disk.config import DiskTierConfig
from engine.kv_cache.disk.manifest import load_manifest, save_manifest
from engine.kv_cache.disk.segment import (
    HEADER_BYTES,
    SUFFIX,
    CorruptRecord,
    RecordRef,
    encode_record,
    read_record,
    scan,
    segment_header,
)
from engine.kv_cache.disk.stats import DiskTierStats

logger = logging.getLogger("kvserve.engine")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_STOP = object()
REFRESH_INTERVAL_S = 1.0


@dataclass
class _Segment:
    end: int  # offset after the last record indexed
    last_use: int  # LRU tick
    hashes: list[bytes] = field(default_factory=list)


def check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and prove a file can be written there (ValueError)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        with open(probe, "wb") as f:
            f.write(b"x")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"kv_disk_dir {str(directory)!r} is not a writable directory "
                         f"({exc.strerror or exc}); give a directory this server may write, "
                         f"or leave --kv-disk-dir unset") from None


class DiskStore:
    def __init__(self, config: DiskTierConfig, fingerprint: bytes, fingerprint_hex: str,
                 block_bytes: int) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.dir = Path(config.directory) / f"kv-{fingerprint_hex}"
        check_writable(Path(config.directory))
        check_writable(self.dir)
        self._lock = threading.Lock()
        self._index: dict[bytes, RecordRef] = {}
        self._segments: dict[str, _Segment] = {}
        self._fds: dict[str, int] = {}
        self._tick = 0
        self._last_refresh = 0.0
        self.stats = DiskTierStats(enabled=True, capacity_bytes=config.size_bytes)
        self._active: tuple[int, str] | None = None  # (fd, name) of our segment
        self._active_end = 0
        self._load_manifest()
        self.refresh(force=True)
        self.stats.blocks_at_start = len(self._index)
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_blocks)
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._thread.start()

    # ---- look-ups and reads (any thread) ---------------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, hashes) -> int:
        """How many leading ``hashes`` the index holds (refreshing it at most once a second
        when the first one is missing: another server may have written it)."""
        n = 0
        for h in hashes:
            if h not in self._index:
                if n == 0 and self.refresh():
                    return self.lookup(hashes)
                break
            n += 1
        return n

    def read(self, block_hash: bytes) -> bytes | None:
        """Verified payload of ``block_hash``, or None (not held, gone, or corrupt)."""
        ref = self._index.get(block_hash)
        if ref is None:
            return None
        t0 = time.perf_counter()
        try:
            fd = self._fd(ref.segment)
            payload = read_record(fd, ref.offset, block_hash, ref.length)
        except FileNotFoundError:
            self._forget_segment(ref.segment)
            return None
        except (CorruptRecord, OSError) as exc:
            logger.warning("kv disk tier: block %s in %s at %d is bad (%s): dropped, "
                           "recomputed instead", block_hash.hex()[:16], ref.segment, ref.offset,
                           exc)
            with self._lock:
                if self._index.get(block_hash) == ref:
                    del self._index[block_hash]
                self.stats.checksum_failures += 1
            return None
        if len(payload) != self.block_bytes:
            return None
        with self._lock:
            self._tick += 1
            seg = self._segments.get(ref.segment)
            if seg is not None:
                seg.last_use = self._tick
            self.stats.read_bytes += len(payload)
            self.stats.read_seconds += time.perf_counter() - t0
        return payload

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = os.open(self.dir / name, os.O_RDONLY)
            with self._lock:
                old = self._fds.setdefault(name, fd)
            if old != fd:
                os.close(fd)
                fd = old
        return fd

    # ---- writes (engine thread queues, the writer thread writes) -----------------------
    def submit(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue one block for writing; False (counted as dropped) when the queue is full or
        the disk is full. Never blocks."""
        if self.stats.disk_full:
            self.stats.dropped_writes += 1
            return False
        try:
            self._queue.put_nowait((block_hash, payload))
        except queue.Full:
            self.stats.dropped_writes += 1
            return False
        return True

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write has been attempted (tests, shutdown)."""
        done = threading.Event()
        try:
            self._queue.put((None, done), timeout=timeout)
        except queue.Full:
            return
        done.wait(timeout)

    def close(self) -> None:
        """Write what is queued, stop the writer, release the active segment, save the
        manifest. Idempotent."""
        if self._thread.is_alive():
            self._queue.put((_STOP, None))
            self._thread.join(timeout=60)
        self._close_active()
        self._save_manifest()
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def _write_loop(self) -> None:
        while True:
            block_hash, payload = self._queue.get()
            if block_hash is _STOP:
                return
            if block_hash is None:
                payload.set()
                continue
            try:
                self._write(block_hash, payload)
            except Exception:  # noqa: BLE001 - the writer must outlive any one write
                logger.exception("kv disk tier: writing a block failed")

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        if self.stats.disk_full:
            self.stats.dropped_writes += 1
            return
        if block_hash in self._index:
            return
        t0 = time.perf_counter()
        if self._active is None:
            self._open_active()
            if self._active is None:
                return
        fd, name = self._active
        record = encode_record(block_hash, payload)
        offset = self._active_end
        try:
            _write_all(fd, record)
        except OSError as exc:
            self._stop_writing(exc, fd, offset)
            return
        self._active_end = offset + len(record)
        with self._lock:
            self._tick += 1
            seg = self._segments.setdefault(name, _Segment(HEADER_BYTES, self._tick))
            seg.hashes.append(block_hash)
            seg.end = self._active_end
            seg.last_use = self._tick
            self._index[block_hash] = RecordRef(name, offset, len(payload))
            self.stats.written_blocks += 1
            self.stats.write_bytes += len(record)
            self.stats.write_seconds += time.perf_counter() - t0
        if self._active_end >= self.config.segment_bytes:
            self._close_active()
            self._evict(self.config.size_bytes - self.config.segment_bytes)

    def _open_active(self) -> None:
        self._evict(self.config.size_bytes - self.config.segment_bytes)
        name = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        try:
            fd = os.open(self.dir / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as exc:
            self._stop_writing(exc, None, 0)
            return
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours alone: no other server evicts or writes it
        try:
            _write_all(fd, segment_header(self.fingerprint))
        except OSError as exc:
            self._stop_writing(exc, fd, 0)
            os.close(fd)
            os.unlink(self.dir / name)
            return
        self._active, self._active_end = (fd, name), HEADER_BYTES
        with self._lock:
            self._tick += 1
            self._segments[name] = _Segment(HEADER_BYTES, self._tick)

    def _close_active(self) -> None:
        if self._active is not None:
            os.close(self._active[0])
            self._active = None

    def _stop_writing(self, exc: OSError, fd: int | None, good_end: int) -> None:
        if fd is not None and good_end:
            try:
                os.ftruncate(fd, good_end)  # no partial record left behind
            except OSError:
                pass
        self.stats.disk_full = True
        self.stats.dropped_writes += 1
        what = "the disk is full" if exc.errno in _FULL_ERRNOS else "a write failed"
        logger.error("kv disk tier: %s in %s (%s): the tier stops writing; it keeps serving "
                     "the %d blocks it holds", what, self.dir, exc.strerror or exc,
                     len(self._index))

    # ---- index maintenance ------------------------------------------------------------
    def refresh(self, force: bool = False) -> bool:
        """Pick up segments other servers wrote or deleted since the last call (at most once
        a second unless ``force``). Returns True if the index gained blocks."""
        now = time.monotonic()
        if not force and now - self._last_refresh < REFRESH_INTERVAL_S:
            return False
        self._last_refresh = now
        try:
            entries = sorted((e.stat().st_mtime_ns, e.name, e.stat().st_size)
                             for e in os.scandir(self.dir) if e.name.endswith(SUFFIX))
        except OSError:
            return False
        present = {name for _, name, _ in entries}
        active = self._active[1] if self._active is not None else None
        for name in [n for n in self._segments if n not in present and n != active]:
            self._forget_segment(name)
        gained = False
        for _, name, size in entries:
            seg = self._segments.get(name)
            if name == active or (seg is not None and seg.end >= size):
                continue
            try:
                records, end, ok = scan(str(self.dir / name), self.fingerprint,
                                        seg.end if seg is not None else 0)
            except OSError:
                continue
            if not ok:
                continue
            with self._lock:
                self._tick += 1
                seg = self._segments.setdefault(name, _Segment(HEADER_BYTES, self._tick))
                for h, off, n in records:
                    if n == self.block_bytes and h not in self._index:
                        self._index[h] = RecordRef(name, off, n)
                        seg.hashes.append(h)
                        gained = True
                seg.end = end
        return gained

    def _forget_segment(self, name: str) -> None:
        with self._lock:
            seg = self._segments.pop(name, None)
            fd = self._fds.pop(name, None)
            if seg is not None:
                for h in seg.hashes:
                    ref = self._index.get(h)
                    if ref is not None and ref.segment == name:
                        del self._index[h]
        if fd is not None:
            os.close(fd)

    def _evict(self, target: int) -> None:
        """Delete least recently used segments until the directory's segments take at most
        ``target`` bytes. Another server evicting at the moment: skip this time."""
        try:
            lock = os.open(self.dir / "evict.lock", os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:
            return
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return
            total = self.used_bytes()
            if total <= target:
                return
            self.refresh(force=True)
            active = self._active[1] if self._active is not None else None
            order = sorted((s.last_use, n) for n, s in self._segments.items() if n != active)
            for _, name in order:
                if total <= target:
                    break
                path = self.dir / name
                try:
                    size = path.stat().st_size
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    self._forget_segment(name)
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a writer holds it: skip
                except OSError:
                    os.close(fd)
                    continue
                nblocks = len(self._segments[name].hashes) if name in self._segments else 0
                path.unlink(missing_ok=True)
                os.close(fd)
                self._forget_segment(name)
                self.stats.evicted_blocks += nblocks
                total -= size
        finally:
            os.close(lock)

    def used_bytes(self) -> int:
        """Bytes of every segment file under this fingerprint (every server's)."""
        try:
            return sum(e.stat().st_size for e in os.scandir(self.dir) if e.name.endswith(SUFFIX))
        except OSError:
            return 0

    def snapshot(self) -> DiskTierStats:
        s = DiskTierStats(**vars(self.stats))
        s.blocks = len(self._index)
        s.used_bytes = self.used_bytes()
        return s

    # ---- manifest (a start-up shortcut; see engine.kv_cache.disk.manifest) -------------
    def _save_manifest(self) -> None:
        with self._lock:
            data = {name: (seg.end, [(h, self._index[h].offset) for h in seg.hashes
                                     if h in self._index and self._index[h].segment == name])
                    for name, seg in self._segments.items()}
        save_manifest(self.dir, self.block_bytes, data)

    def _load_manifest(self) -> None:
        for name, (end, records) in load_manifest(self.dir, self.fingerprint,
                                                  self.block_bytes).items():
            seg = self._segments[name] = _Segment(end, 0)
            for h, off in records:
                self._index[h] = RecordRef(name, off, self.block_bytes)
                seg.hashes.append(h)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
