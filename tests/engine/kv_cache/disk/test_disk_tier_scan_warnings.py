"""Segments the start-up scan skips, wholly (a header that is not a segment's or names another
fingerprint, a file shorter than a header) or in part (a torn tail), are logged: one WARNING
each, naming the file and why. Another server's segment still being written is not torn."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from pathlib import Path

from engine.config.kv_disk import DiskTierConfig
from engine.kv_cache.disk.store import DiskStore
from tests.support.disk_blocks import BLOCK, block_hash

FP_A = hashlib.sha256(b"model-a").digest()
FP_B = hashlib.sha256(b"model-b").digest()



def _store(d: Path, fp: bytes = FP_A) -> DiskStore:
    return DiskStore(DiskTierConfig(str(d), 1 << 22, segment_bytes=1 << 20), fp, fp.hex()[:24],
                     BLOCK)


def _write_segment(d: Path, fp: bytes, ids) -> Path:
    s = _store(d, fp)
    for i in ids:
        assert s.submit(block_hash(i), (block_hash(i) * 32)[:BLOCK])
    s.flush()
    s.close()
    (s.dir / "manifest.json").unlink()  # scanned at the next start
    (seg,) = s.dir.glob("*.kvs")
    return seg


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_each_skipped_segment_is_one_warning_naming_file_and_reason(tmp_path, caplog):
    torn = _write_segment(tmp_path, FP_A, range(5))
    os.truncate(torn, torn.stat().st_size - 10)
    own = torn.parent
    other = _write_segment(tmp_path / "b", FP_B, range(5))
    moved = own / ("00000000000000000001-1-aaaaaaaa.kvs")
    moved.write_bytes(other.read_bytes())  # another fingerprint's header in our directory
    short = own / "00000000000000000002-1-bbbbbbbb.kvs"
    short.write_bytes(b"KVSEG")
    junk = own / "00000000000000000003-1-cccccccc.kvs"
    junk.write_bytes(b"x" * 100)
    caplog.clear()
    caplog.set_level(logging.INFO, logger="kvserve.engine")
    s = _store(tmp_path)
    try:
        assert len(s) == 4  # the torn segment's whole records are kept
        warned = _warnings(caplog)
        for path, why in ((torn, "torn"), (moved, "another fingerprint"),
                          (short, "shorter than"), (junk, "not a segment")):
            mine = [w for w in warned if path.name in w]
            assert len(mine) == 1, (path.name, warned)
            assert why in mine[0], mine[0]
        assert len(warned) == 4
    finally:
        s.close()


def test_a_segment_another_writer_holds_is_not_called_torn(tmp_path, caplog):
    seg = _write_segment(tmp_path, FP_A, range(3))
    with open(seg, "ab") as f:  # a record being appended by its (locked) writer
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        f.write(b"KVB1" + b"\0" * 10)
        f.flush()
        caplog.set_level(logging.INFO, logger="kvserve.engine")
        s = _store(tmp_path)
        try:
            assert len(s) == 3 and not _warnings(caplog)
        finally:
            s.close()
