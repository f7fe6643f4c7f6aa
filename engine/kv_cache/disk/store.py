"""DiskStore: one fingerprint's segment files under ``DIR/kv-<fingerprint>/``; non-blocking
queued writes, verified reads, a size bound over the whole directory, failing open. The full
contract is on :class:`DiskStore`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.kv_disk import DiskTierConfig
from engine.kv_cache.disk.budget import (
    directory_bytes,
    evict_lock,
    evict_others,
    held,
    hold_in_use,
    prune_orphans,
    release_in_use,
)
from engine.kv_cache.disk.health import DiskHealth, RetryPolicy
from engine.kv_cache.disk.manifest import load_manifest, save_manifest
from engine.kv_cache.disk.queued_writes import QueuedWrites
from engine.kv_cache.disk.segment import (
    HEADER_BYTES,
    RECORD_HEADER_BYTES,
    SUFFIX,
    CorruptRecord,
    RecordRef,
    encode_record,
    header_problem,
    read_record,
    scan,
    segment_header,
)
from engine.kv_cache.disk.stats import DiskTierStats

logger = logging.getLogger("kvserve.engine")
_STOP = object()
REFRESH_INTERVAL_S = 1.0


@dataclass
class _Segment:
    end: int  # offset after the last record indexed
    last_use: int  # LRU tick
    hashes: list[bytes] = field(default_factory=list)


def _probe(directory: Path) -> None:
    """Prove a file can be written in ``directory`` (``OSError`` otherwise)."""
    path = directory / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        _write_all(fd, b"x")
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()


class DiskStore(QueuedWrites):
    """Contract:

    * Start-up: the directory is created if needed and proven writable; if it cannot be (full,
      read-only, not creatable) the store starts all the same, without writing. The index
      (block hash -> record) is rebuilt from the segments themselves, helped by
      ``manifest.json`` (written at close) only for segments whose size it states exactly. A
      segment whose header is not this fingerprint's is skipped and a torn tail ends its
      segment, each said by one WARNING naming the file. Then orphans are pruned and the
      directory brought under its size (``engine.kv_cache.disk.budget``).
    * ``submit(hash, payload)`` queues a write and never blocks: with the queue full, or after
      the disk filled up, the block is dropped and counted. One writer thread appends records to
      this server's active segment (created exclusively, held under ``flock``) and starts a new
      one past ``segment_bytes``; other servers' segments are never written.
    * ``read(hash)`` returns verified payload bytes or None; a record failing its checks is
      logged, counted and removed from the index (never returned).
    * ``size_bytes`` bounds the whole directory, every fingerprint's files together: before a
      new segment is started, other fingerprints nobody uses are evicted first (least recently
      used first), then this one's least recently used whole segments (a read refreshes its
      segment); a segment another writer holds is skipped; ``DIR/kv-evict.lock`` keeps two
      servers from evicting at once. Segments other servers add or delete are picked up by
      :meth:`refresh` (called by look-ups at most once a second, and before evicting).
    * A failed write (disk full, read-only, an I/O error, the directory deleted) cuts the
      partial record off and marks the tier down (``engine.kv_cache.disk.health``: one WARNING,
      counted in ``stats.write_errors``; ``stats.disk_full`` only when the disk is full); while
      down, blocks are dropped, reads go on, and the writer thread retries with backoff,
      recreating the directory; a retry that finds it usable resumes writing.
    """

    def __init__(self, config: DiskTierConfig, fingerprint: bytes, fingerprint_hex: str,
                 block_bytes: int, retry: RetryPolicy = RetryPolicy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Never raises for the directory's sake: one that cannot be used starts the store
        down (class docstring). ``retry``: the backoff; ``clock``: its time (tests)."""
        self.config = config
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.base = Path(config.directory)
        self.dir = self.base / f"kv-{fingerprint_hex}"
        self.health = DiskHealth(self.base, retry, clock)
        # before a new segment: room for it and the record that may take it past its size
        self._room = max(0, config.size_bytes - config.segment_bytes - RECORD_HEADER_BYTES
                         - block_bytes)
        self._lock = threading.Lock()
        self._index: dict[bytes, RecordRef] = {}
        self._segments: dict[str, _Segment] = {}
        self._fds: dict[str, int] = {}
        self._tick = 0
        self._last_refresh = 0.0
        self.stats = DiskTierStats(enabled=True, capacity_bytes=config.size_bytes,
                                   available=True)
        self._active: tuple[int, str] | None = None  # (fd, name) of our segment
        self._active_end = 0
        self._in_use: int | None = None  # our shared lock on the fingerprint directory
        self._drop_active = False  # clear(): the writer deletes its active segment next
        try:
            self._open_dir()
        except OSError as exc:
            self._failed("opening the directory", exc)
        self._load_manifest()  # what a directory we cannot write still holds is read
        self.refresh(force=True, warn=True)
        self.stats.blocks_at_start = len(self._index)
        if self.health.available:
            self._tidy()
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

    # ---- the directory: claimed, proven writable, tidied ----------------------------------
    def _open_dir(self) -> None:
        """Create the directories, hold our fingerprint's ``in-use.lock`` and write a probe
        file (``OSError`` when any of it fails)."""
        if self._in_use is not None:  # a retry: the directory may have been recreated
            release_in_use(self._in_use)
            self._in_use = None
        self.base.mkdir(parents=True, exist_ok=True)
        self._in_use = hold_in_use(self.dir)
        _probe(self.dir)

    def _tidy(self) -> None:
        """Start-up: prune orphans, bring the directory under its size."""
        with evict_lock(self.base) as mine:
            if not mine:
                return
            removed = prune_orphans(self.base)
            if removed:
                self.stats.pruned_files += len(removed)
                logger.info("kv disk tier: pruned %d orphaned files (temporary files, files "
                            "without a segment header, unused fingerprint directories with "
                            "no segment) from %s", len(removed), self.base)
            self._evict_locked(self.config.size_bytes)

    def _failed(self, what: str, exc: OSError) -> None:
        self.health.failed(what, exc)
        self._sync_health()

    def _sync_health(self) -> None:
        h = self.health
        self.stats.available, self.stats.disk_full = h.available, h.full and not h.available
        self.stats.write_errors = h.errors

    def _retry(self) -> None:
        """Writer thread, a retry being due: writes resume if the directory is usable."""
        try:
            self._open_dir()
        except OSError as exc:
            self._failed("retrying", exc)
            return
        self.health.usable()
        self._sync_health()
        self.refresh(force=True)  # a deleted directory's segments are forgotten

    @property
    def writable(self) -> bool:
        """Writes are accepted (the tier is not down)."""
        return self.health.available

    # ---- writes (engine thread queues, the writer thread writes) -----------------------
    # submit() and flush(): QueuedWrites (engine/kv_cache/disk/queued_writes.py)

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
        if self._in_use is not None:
            release_in_use(self._in_use)
            self._in_use = None

    def _wait_s(self) -> float | None:
        """How long the writer may sleep waiting for work: for ever while up, until the next
        retry while down."""
        if self.health.available:
            return None
        return min(max(self.health.seconds_to_retry(), 0.05), self.health.policy.max_s)

    def _write_loop(self) -> None:
        while True:
            try:
                block_hash, payload = self._queue.get(timeout=self._wait_s())
            except queue.Empty:
                block_hash = payload = None
            if self.health.retry_due():
                try:
                    self._retry()
                except Exception as exc:  # noqa: BLE001 - as for a write: the writer lives on
                    logger.exception("kv disk tier: retrying the directory failed")
                    self._failed("retrying", OSError(f"{type(exc).__name__}: {exc}"))
            if self._drop_active:
                self._discard_active()
            if block_hash is None and payload is None:
                continue
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
        if not self.health.available:
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
            if os.fstat(fd).st_nlink == 0:  # deleted under us: the bytes would go nowhere
                raise FileNotFoundError(errno.ENOENT, "the segment file was deleted",
                                        str(self.dir / name))
            _write_all(fd, record)
        except OSError as exc:
            self._write_failed("writing a block", exc, offset)
            return
        self.health.wrote()
        self._active_end = offset + len(record)
        with self._lock:
            if self._drop_active:  # cleared while this block was in hand: the segment goes
                return
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
            self._evict(self._room)

    def _open_active(self) -> None:
        self._evict(self._room)
        name = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        try:
            fd = os.open(self.dir / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as exc:
            self._write_failed("creating a segment", exc)
            return
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours alone: no other server evicts or writes it
        try:
            _write_all(fd, segment_header(self.fingerprint))
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.dir / name)
            self._write_failed("writing a segment header", exc)
            return
        self._active, self._active_end = (fd, name), HEADER_BYTES
        with self._lock:
            self._tick += 1
            self._segments[name] = _Segment(HEADER_BYTES, self._tick)

    def _close_active(self) -> None:
        if self._active is not None:
            os.close(self._active[0])
            self._active = None

    def _write_failed(self, what: str, exc: OSError, good_end: int = 0) -> None:
        """A write failed: the active segment (if any) is cut back to its last whole record
        and closed (a directory gone or read-only needs a new one), the block dropped, the
        tier down until a retry."""
        if self._active is not None:
            if good_end:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._active[0], good_end)  # no partial record left behind
            self._close_active()
        self.stats.dropped_writes += 1
        self._failed(what, exc)

    # ---- clearing (POST /flush_cache, /reset_prefix_cache) ------------------------------
    def clear(self) -> int:
        """Drop every block of this fingerprint: the writes still queued, the segments no other
        writer holds (deleted: this fingerprint's, other servers' closed ones included: they
        are the same model's cache) and this server's active segment (the writer thread closes
        and deletes it before its next write). Another server's active segment stays: its
        blocks are shared. Returns how many indexed blocks were dropped. Any thread; never
        waits for the writer."""
        self._drain_queue()
        with self._lock:
            active = self._active[1] if self._active is not None else None
            names = [n for n in self._segments if n != active]
            self._drop_active = True  # also a block the writer has in hand (``_write``)
        dropped = 0
        if active is not None:  # forgotten now; the file goes when the writer is next awake
            dropped = self._count_indexed(active)
            self._forget_segment(active)
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait((None, None))  # wake an idle writer
        for name in names:
            path = self.dir / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # already gone
                dropped += self._count_indexed(name)
                self._forget_segment(name)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another writer's: keep it
            except OSError:
                os.close(fd)
                continue
            n = self._count_indexed(name)
            path.unlink(missing_ok=True)
            os.close(fd)
            self._forget_segment(name)
            dropped += n
        return dropped

    def _count_indexed(self, name: str) -> int:
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                return 0
            return sum(1 for h in seg.hashes
                       if (ref := self._index.get(h)) is not None and ref.segment == name)

    def _drain_queue(self) -> None:
        """Drop the writes still queued (flush markers are answered, a stop is kept)."""
        keep = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            block_hash, payload = item
            if block_hash is _STOP:
                keep.append(item)
            elif block_hash is None and payload is not None:
                payload.set()  # a flush() waiting: the writes it waited for are gone
        for item in keep:
            self._queue.put_nowait(item)

    def _discard_active(self) -> None:
        """Writer thread, after :meth:`clear`: delete and forget the active segment."""
        with self._lock:
            self._drop_active = False
        if self._active is None:
            return
        name = self._active[1]
        self._close_active()
        with contextlib.suppress(OSError):
            (self.dir / name).unlink()
        self._forget_segment(name)

    # ---- index maintenance ------------------------------------------------------------
    def refresh(self, force: bool = False, warn: bool = False) -> bool:
        """Pick up segments other servers wrote or deleted since the last call (at most once
        a second unless ``force``). Returns True if the index gained blocks. ``warn`` (start):
        one WARNING for each segment skipped (its header) or cut short (a torn tail that no
        writer is appending to)."""
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
                if warn:
                    logger.warning("kv disk tier: segment %s skipped: %s", self.dir / name,
                                   self._header_problem(name))
                continue
            if warn and end < size and not held(self.dir / name):
                logger.warning("kv disk tier: segment %s has a torn tail (a record cut short "
                               "or garbled at byte %d of %d): its %d whole records are kept, "
                               "the rest is ignored", self.dir / name, end, size, len(records))
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

    def _header_problem(self, name: str) -> str:
        try:
            with open(self.dir / name, "rb") as f:
                header = f.read(HEADER_BYTES)
        except OSError as exc:
            return f"unreadable ({exc.strerror or exc})"
        return header_problem(header, self.fingerprint) or "its header changed while read"

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
        """Evict until the directory (every fingerprint's files) takes at most ``target``
        bytes: other fingerprints nobody uses first, then this one's least recently used
        segments. Another server evicting at the moment: skip this time."""
        with evict_lock(self.base) as mine:
            if mine:
                self._evict_locked(target)

    def _evict_locked(self, target: int) -> None:
        total = directory_bytes(self.base)
        if total <= target:
            return
        others = evict_others(self.base, self.dir, total - target)
        self.stats.evicted_foreign_segments += others.segments
        total -= others.bytes
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

    def used_bytes(self) -> int:
        """Bytes of the whole directory's fingerprint sub-directories (every fingerprint's,
        every server's): what ``size_bytes`` bounds."""
        return directory_bytes(self.base)

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
