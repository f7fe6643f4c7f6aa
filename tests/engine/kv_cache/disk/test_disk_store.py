"""The disk KV tier's store against its faults: every read returns the bytes written under that
hash or nothing. Truncated segments, flipped bytes, a deleted manifest, another fingerprint's
directory, a read-only directory, a filling disk, two servers on one directory, a full writer
queue, LRU eviction under the size, and SIGKILL during writes (a child process)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.config.kv_disk import DiskTierConfig, parse_size
from engine.kv_cache.disk import store as store_mod
from engine.kv_cache.disk.segment import HEADER_BYTES, RECORD_HEADER_BYTES
from engine.kv_cache.disk.store import DiskStore
from tests.support.disk_blocks import BLOCK, block_hash, fill, payload, readable

FP_A = hashlib.sha256(b"model-a").digest()
FP_B = hashlib.sha256(b"model-b").digest()




def _store(d: Path, fp: bytes = FP_A, size: str = "8MiB", seg: int = 8192,
           queue_blocks: int = 256) -> DiskStore:
    cfg = DiskTierConfig(str(d), parse_size(size), segment_bytes=seg, queue_blocks=queue_blocks)
    return DiskStore(cfg, fp, fp.hex()[:24], BLOCK)




def _segments(s: DiskStore) -> list[Path]:
    return sorted(s.dir.glob("*.kvs"))


def test_round_trip_and_index_rebuilt_without_manifest(tmp_path):
    s = _store(tmp_path)
    fill(s, range(20))
    assert readable(s, range(20)) == 20
    s.close()
    assert (s.dir / "manifest.json").is_file()
    s2 = _store(tmp_path)  # from the manifest
    assert len(s2) == 20 and readable(s2, range(20)) == 20
    s2.close()
    (s2.dir / "manifest.json").unlink()
    s3 = _store(tmp_path)  # rebuilt from the segments
    assert s3.stats.blocks_at_start == 20 and readable(s3, range(20)) == 20
    s3.close()


def test_truncated_segment_loses_only_its_tail(tmp_path):
    s = _store(tmp_path, seg=1 << 20)  # one segment
    fill(s, range(6))
    s.close()
    (s.dir / "manifest.json").unlink()
    seg = _segments(s)[0]
    size = seg.stat().st_size
    os.truncate(seg, size - 10)  # the last record is cut
    s2 = _store(tmp_path, seg=1 << 20)
    assert readable(s2, range(6)) == 5 and s2.read(block_hash(5)) is None
    s2.close()


def test_stale_manifest_and_truncation_never_serve_wrong_bytes(tmp_path):
    s = _store(tmp_path, seg=1 << 20)
    fill(s, range(6))
    s.close()
    seg = _segments(s)[0]
    os.truncate(seg, HEADER_BYTES + 2 * (RECORD_HEADER_BYTES + BLOCK) + 7)
    s2 = _store(tmp_path, seg=1 << 20)  # the manifest's size no longer matches: rescanned
    assert readable(s2, range(6)) == 2
    s2.close()


def test_flipped_bytes_are_a_miss_counted_and_dropped(tmp_path):
    s = _store(tmp_path, seg=1 << 20)
    fill(s, range(4))
    s.close()
    seg = _segments(s)[0]
    data = bytearray(seg.read_bytes())
    data[HEADER_BYTES + (RECORD_HEADER_BYTES + BLOCK) * 2 + RECORD_HEADER_BYTES + 123] ^= 0x40
    seg.write_bytes(bytes(data))
    s2 = _store(tmp_path, seg=1 << 20)
    assert s2.read(block_hash(2)) is None
    assert s2.stats.checksum_failures == 1 and block_hash(2) not in s2
    assert readable(s2, [0, 1, 3]) == 3
    s2.close()


def test_another_fingerprint_is_never_read(tmp_path):
    a = _store(tmp_path, FP_A)
    fill(a, range(5))
    a.close()
    b = _store(tmp_path, FP_B)
    assert len(b) == 0 and b.read(block_hash(0)) is None
    # a segment of A's copied into B's directory: its header names A, it is ignored
    for seg in _segments(a):
        (b.dir / seg.name).write_bytes(seg.read_bytes())
    b.refresh(force=True)
    assert len(b) == 0 and b.read(block_hash(0)) is None
    b.close()


def test_read_only_dir_starts_the_store_down(tmp_path, caplog):
    """An optional cache never stops the server: the store starts without writing, says so
    naming the directory (recovery: tests/engine/kv_cache/disk/test_disk_tier_health.py)."""
    target = "/proc/kvserve-disk-tier-test" if os.geteuid() == 0 else str(tmp_path / "ro")
    if os.geteuid() != 0:
        os.mkdir(target, 0o555)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for d in (Path(target), blocker):
        s = _store(d)
        try:
            assert not s.stats.available and not s.submit(block_hash(0), payload(block_hash(0)))
            assert str(d) in caplog.text
        finally:
            s.close()


def test_disk_full_stops_writing_and_keeps_serving(tmp_path, monkeypatch, caplog):
    budget = {"left": HEADER_BYTES + 3 * (RECORD_HEADER_BYTES + BLOCK) + 100}
    real = store_mod._write_all

    def limited(fd, data):  # a small quota: ENOSPC once it is spent, after a partial write
        if len(data) > budget["left"]:
            os.write(fd, data[:budget["left"]])
            budget["left"] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget["left"] -= len(data)
        real(fd, data)

    monkeypatch.setattr(store_mod, "_write_all", limited)
    s = _store(tmp_path, seg=1 << 20)
    for i in range(6):
        s.submit(block_hash(i), payload(block_hash(i)))
    s.flush()
    assert s.stats.disk_full and "disk is full" in caplog.text
    assert not s.submit(block_hash(99), payload(block_hash(99)))
    assert s.stats.dropped_writes >= 3
    assert readable(s, range(6)) == 3
    s.close()
    monkeypatch.setattr(store_mod, "_write_all", real)
    (s.dir / "manifest.json").unlink()
    s2 = _store(tmp_path, seg=1 << 20)  # the partial record was cut off
    assert len(s2) == 3 and readable(s2, range(6)) == 3
    s2.close()


def test_two_servers_share_one_dir(tmp_path):
    a, b = _store(tmp_path), _store(tmp_path)
    threads = [threading.Thread(target=fill, args=(a, range(0, 30))),
               threading.Thread(target=fill, args=(b, range(30, 60)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.refresh(force=True)
    b.refresh(force=True)
    assert readable(a, range(60)) == 60 and readable(b, range(60)) == 60
    for st in (a, b):  # one writer per segment: the active one is locked against others
        fd = os.open(st.dir / st._active[1], os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    a._evict(0)  # evicting everything skips b's active segment
    assert (b.dir / b._active[1]).exists()
    a.close()
    b.close()
    c = _store(tmp_path)
    assert readable(c, range(60)) == len(c) > 0
    c.close()


def test_lru_eviction_keeps_the_size_and_recent_blocks(tmp_path):
    s = _store(tmp_path, size=str(6 * 8192), seg=8192)
    fill(s, range(10))
    for i in range(5):
        assert s.read(block_hash(i)) is not None  # used again: newer than 5..9
    fill(s, range(10, 60))
    assert s.used_bytes() <= 6 * 8192
    assert s.stats.evicted_blocks > 0
    assert readable(s, range(60)) == len(s)
    s.close()


def test_full_queue_drops_instead_of_blocking(tmp_path, monkeypatch):
    s = _store(tmp_path, queue_blocks=1)
    gate = threading.Event()
    real = s._write
    monkeypatch.setattr(s, "_write", lambda h, p: (gate.wait(10), real(h, p)))
    results = [s.submit(block_hash(i), payload(block_hash(i))) for i in range(5)]
    assert results.count(False) >= 3 and s.stats.dropped_writes >= 3
    gate.set()
    s.flush()
    assert readable(s, range(5)) == results.count(True)
    s.close()


@pytest.mark.parametrize("open_segment", [False, True])
def test_a_block_in_the_writers_hands_goes_with_a_clear(tmp_path, monkeypatch, open_segment):
    """``clear()`` while the writer holds a block it took from the queue before (no segment
    open yet, or one open): that block is not indexed, its segment goes, none survives a
    restart; blocks submitted after the clear are written."""
    s = _store(tmp_path)
    if open_segment:
        fill(s, range(3))
    taken, gate = threading.Event(), threading.Event()
    real = s._write

    def held(h, p):
        if h == block_hash(10):
            taken.set()
            gate.wait(10)
        real(h, p)

    monkeypatch.setattr(s, "_write", held)
    s.submit(block_hash(10), payload(block_hash(10)))
    assert taken.wait(10)  # in the writer's hands
    s.clear()
    gate.set()
    s.flush()
    assert len(s) == 0 and readable(s, [10]) == 0
    fill(s, range(20, 23))  # after the clear: written as usual
    assert readable(s, range(20, 23)) == 3
    s.close()
    again = _store(tmp_path)
    assert readable(again, [10]) == 0 and readable(again, range(20, 23)) == 3
    again.close()


_WRITER = """
import hashlib, sys
from engine.config.kv_disk import DiskTierConfig
from engine.kv_cache.disk.store import DiskStore
fp = hashlib.sha256(b"model-a").digest()
s = DiskStore(DiskTierConfig(sys.argv[1], 1 << 30, segment_bytes=8192), fp, fp.hex()[:24], 1000)
i, told = 0, False
while True:  # writes go on until the SIGKILL
    h = hashlib.sha256(f"block-{i}".encode()).digest()
    if s.submit(h, (h * 32)[:1000]):
        i += 1
    if s.stats.written_blocks >= 50 and not told:
        print("ready", flush=True)
        told = True
"""


def test_sigkill_during_writes_loses_at_most_the_tail(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    s = _store(tmp_path)
    assert len(s) >= 50
    assert readable(s, range(len(s) + 200)) == len(s)  # everything indexed reads right
    s.close()


def test_config_errors_name_the_fix():
    from engine.config.engine import EngineConfig

    with pytest.raises(ValueError, match="needs both kv_disk_dir and kv_disk_size"):
        EngineConfig(kv_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="below two segments"):
        EngineConfig(kv_disk_dir="/tmp/x", kv_disk_size="1KiB")
    with pytest.raises(ValueError, match="cannot read the size"):
        EngineConfig(kv_disk_dir="/tmp/x", kv_disk_size="lots")
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(kv_disk_dir="/tmp/x", kv_disk_size="1GiB", enable_prefix_caching=False)
    assert EngineConfig(kv_disk_dir="/tmp/x", kv_disk_size="1GiB").kv_disk_size == 2**30


def test_kv_calc_counts_the_tokens_a_disk_size_holds():
    from loadgen.kv_calc import disk_report

    r = disk_report(1000, "1MiB", 16)
    assert r["bytes_per_block"] == 16 * 1000 + RECORD_HEADER_BYTES
    assert r["blocks"] == 2**20 // r["bytes_per_block"] and r["tokens"] == 16 * r["blocks"]
    # a hybrid KV cache of 6 groups: a block of tokens is 6 records (one group's layers each)
    h = disk_report(1000, "1MiB", 16, num_groups=6)
    assert h["bytes_per_block"] == 16 * 1000 + 6 * RECORD_HEADER_BYTES
