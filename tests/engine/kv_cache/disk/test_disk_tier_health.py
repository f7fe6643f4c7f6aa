"""The disk tier fails open: a directory that cannot be created, written or read at start, a
write that fails while serving (disk full, read-only, I/O error) and a directory deleted under
the server all leave the store serving without writing (one WARNING per transition, the errors
counted, ``available`` false), retrying with bounded exponential backoff, and writing again once
the directory is usable (a deleted one recreated, never reported as full).

Time is a fake clock the test advances: a retry is due when the clock says so, and the writer
notices at its next wake-up (``flush`` wakes it), so nothing here waits on real time."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
from pathlib import Path

import pytest

from engine.config.kv_disk import DiskTierConfig
from engine.kv_cache.disk import store as store_mod
from engine.kv_cache.disk.health import DiskHealth, RetryPolicy
from engine.kv_cache.disk.store import DiskStore
from tests.support.disk_blocks import BLOCK, block_hash, payload, readable, submit_all

FP = hashlib.sha256(b"model-a").digest()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds




def _store(d: Path, clock: FakeClock, seg: int = 8192) -> DiskStore:
    cfg = DiskTierConfig(str(d), 1 << 22, segment_bytes=seg)
    return DiskStore(cfg, FP, FP.hex()[:24], BLOCK, clock=clock)




def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "kv disk tier" in r.getMessage()]


def test_unusable_dir_at_start_serves_without_the_tier_then_resumes(tmp_path, caplog):
    """A path under a regular file (no chmod trick: tests may run as root) cannot be created:
    the store starts anyway, says why once, drops writes, and resumes when the path works."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    target = blocker / "kv"
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="kvserve.engine")
    s = _store(target, clock)  # today: ValueError "not a writable directory"
    try:
        assert not s.stats.available and not s.stats.disk_full
        warned = _warnings(caplog)
        assert len(warned) == 1 and str(target) in warned[0]
        assert os.strerror(errno.ENOTDIR) in warned[0] or "Not a directory" in warned[0]
        assert not s.submit(block_hash(0), payload(block_hash(0))) and s.stats.dropped_writes == 1
        clock.advance(0.5)  # not due yet: still down, no second warning
        s.flush()
        assert not s.stats.available and len(_warnings(caplog)) == 1
        blocker.unlink()  # the disk "recovers"
        clock.advance(1.0)
        s.flush()  # wakes the writer: the retry is due
        assert s.stats.available
        assert submit_all(s, range(5)) == 5 and readable(s, range(5)) == 5
        assert any(p.suffix == ".kvs" for p in s.dir.iterdir())
        assert len(_warnings(caplog)) == 1
    finally:
        s.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk_at_start_serves_and_resumes(tmp_path, monkeypatch, caplog,
                                                            code):
    """Every write fails at start (the probe file's too): down, "full" only for ENOSPC."""
    real = store_mod._write_all

    def failing(fd, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store_mod, "_write_all", failing)
    clock = FakeClock()
    s = _store(tmp_path, clock)  # today: ValueError "not a writable directory"
    try:
        assert not s.stats.available and s.stats.disk_full == (code == errno.ENOSPC)
        (warned,) = _warnings(caplog)
        assert str(tmp_path) in warned and os.strerror(code) in warned
        assert ("the disk is full" in warned) == (code == errno.ENOSPC)
        monkeypatch.setattr(store_mod, "_write_all", real)
        clock.advance(1.0)
        s.flush()
        assert s.stats.available and not s.stats.disk_full
        assert submit_all(s, range(3)) == 3 and readable(s, range(3)) == 3
    finally:
        s.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EIO])
def test_write_error_degrades_once_counts_and_resumes(tmp_path, monkeypatch, caplog, code):
    real = store_mod._write_all
    broken = {"on": False}

    def flaky(fd, data):
        if broken["on"]:
            raise OSError(code, os.strerror(code))
        real(fd, data)

    monkeypatch.setattr(store_mod, "_write_all", flaky)
    clock = FakeClock()
    s = _store(tmp_path, clock, seg=1 << 20)
    try:
        assert submit_all(s, range(3)) == 3
        broken["on"] = True
        for i in range(3, 10):  # many blocks, one warning
            s.submit(block_hash(i), payload(block_hash(i)))
        s.flush()
        assert not s.stats.available
        assert s.stats.disk_full == (code == errno.ENOSPC)
        assert s.stats.write_errors >= 1 and s.stats.dropped_writes >= 7
        assert len(_warnings(caplog)) == 1 and os.strerror(code) in _warnings(caplog)[0]
        assert not s.submit(block_hash(50), payload(block_hash(50)))  # down: dropped at once, never queued
        assert readable(s, range(3)) == 3  # reads go on
        errors = s.stats.write_errors
        clock.advance(1.0)  # the retry fails (its probe file cannot be written either):
        s.flush()  # still down, the backoff doubled, no second warning
        assert not s.stats.available and s.stats.write_errors == errors + 1
        assert s.health.delay_s == 2.0 and len(_warnings(caplog)) == 1
        clock.advance(1.0)  # half the backoff: not retried
        s.flush()
        assert not s.stats.available and s.stats.write_errors == errors + 1
        broken["on"] = False  # the disk recovers
        clock.advance(1.0)
        s.flush()
        assert s.stats.available and not s.stats.disk_full
        assert submit_all(s, range(20, 25)) == 5
        assert readable(s, range(20, 25)) == 5 and readable(s, range(3)) == 3
        assert s.health.delay_s == 1.0  # a write succeeded: the backoff starts over
    finally:
        s.close()
    s2 = _store(tmp_path, FakeClock(), seg=1 << 20)  # no partial record was left behind
    try:
        assert readable(s2, range(30)) == len(s2) == 8
    finally:
        s2.close()


@pytest.mark.parametrize("which", ["fingerprint", "whole"])
def test_deleted_dir_is_recreated_and_never_reported_full(tmp_path, caplog, which):
    clock = FakeClock()
    base = tmp_path / "kv"
    s = _store(base, clock)  # 8 blocks a segment
    try:
        assert submit_all(s, range(4)) == 4
        shutil.rmtree(s.dir if which == "fingerprint" else base)
        submit_all(s, range(4, 30))  # today: written into an unlinked file, then "disk full" forever
        assert not s.stats.disk_full
        assert not s.stats.available and s.stats.write_errors >= 1
        assert len(_warnings(caplog)) == 1
        clock.advance(1.0)
        s.flush()
        assert s.stats.available and s.dir.is_dir()
        assert submit_all(s, range(100, 104)) == 4 and readable(s, range(100, 104)) == 4
        assert readable(s, range(4)) == 0  # deleted: misses, never wrong bytes
        assert not s.stats.disk_full
    finally:
        s.close()


def test_backoff_doubles_to_its_bound_and_resets_after_a_write(tmp_path, caplog):
    clock = FakeClock()
    h = DiskHealth(tmp_path, RetryPolicy(first_s=1.0, max_s=8.0), clock=clock)
    exc = OSError(errno.EIO, os.strerror(errno.EIO))
    h.failed("writing", exc)
    delays = []
    for _ in range(6):
        assert not h.retry_due()
        clock.advance(h.seconds_to_retry())
        assert h.retry_due()
        delays.append(h.delay_s)
        h.failed("retrying", exc)
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert h.errors == 7 and len(_warnings(caplog)) == 1
    h.usable()
    assert h.available and h.delay_s == 8.0  # on probation until a write succeeds
    h.failed("writing", exc)  # the same outage: no second warning, the backoff at its bound
    assert not h.available and h.delay_s == 8.0 and len(_warnings(caplog)) == 1
    clock.advance(h.seconds_to_retry())
    h.usable()
    h.wrote()
    assert h.available and h.delay_s == 1.0
    h.failed("writing", exc)  # a new transition: a new warning
    assert len(_warnings(caplog)) == 2
    with pytest.raises(ValueError):
        RetryPolicy(first_s=0.0)
    with pytest.raises(ValueError):
        RetryPolicy(first_s=5.0, max_s=1.0)
