"""``--kv-disk-size`` bounds the whole directory: every fingerprint's sub-directory counts, the
least recently used other fingerprint is evicted first (a model file's new mtime leaves an old
one behind), never one a live store holds; orphans are pruned at start (stale temporary files,
segment files without a valid header, fingerprint directories left with no segment), while
segments without a manifest entry (a crash's) and files kvserve did not make are kept."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from engine.config.kv_disk import DiskTierConfig
from engine.kv_cache.disk.budget import directory_bytes
from engine.kv_cache.disk.store import DiskStore
from tests.support.disk_blocks import BLOCK, fill, readable

SEG = 8192
SIZE = 64 * 1024
FPS = [hashlib.sha256(f"config-{k}".encode()).digest() for k in range(3)]
HOUR_AGO = time.time() - 3600




def _store(d: Path, fp: bytes, size: int = SIZE) -> DiskStore:
    return DiskStore(DiskTierConfig(str(d), size, segment_bytes=SEG), fp, fp.hex()[:24], BLOCK)




def _segments(base: Path, fp: bytes) -> set[str]:
    d = base / f"kv-{fp.hex()[:24]}"
    return {p.name for p in d.glob("*.kvs")} if d.is_dir() else set()


def _age(d: Path) -> None:
    """Every file under ``d`` (and ``d``) last used an hour ago."""
    for p in [*d.rglob("*"), d]:
        os.utime(p, (HOUR_AGO, HOUR_AGO))


def test_three_configurations_share_one_bound_oldest_evicted_first(tmp_path):
    """Three fingerprints, one after another, on one directory: together they stay under the
    size (today each stays under it alone: three times the size), the oldest goes first."""
    a, b, c = FPS
    for fp, ids in ((a, range(0, 40)), (b, range(40, 80))):
        s = _store(tmp_path, fp)
        fill(s, ids)
        s.close()
    _age(tmp_path / f"kv-{a.hex()[:24]}")  # a was last used before b
    b_before = _segments(tmp_path, b)
    s = _store(tmp_path, c)
    try:
        fill(s, range(80, 120))
        assert directory_bytes(tmp_path) <= SIZE
        assert _segments(tmp_path, a) == set()  # the oldest fingerprint went first ...
        assert _segments(tmp_path, b) and _segments(tmp_path, b) < b_before  # ... then b's
        assert readable(s, range(80, 120)) == 40  # the live one's blocks were not touched
        assert s.snapshot().used_bytes == directory_bytes(tmp_path)
    finally:
        s.close()
    assert not (tmp_path / f"kv-{a.hex()[:24]}").exists()  # no empty directory left behind


def test_a_live_fingerprint_is_never_evicted(tmp_path):
    """Another store holding its fingerprint (two servers of different models on one host):
    its segments stay; the newcomer evicts its own oldest blocks to keep the bound."""
    a, c = FPS[0], FPS[2]
    live = _store(tmp_path, a)
    try:
        fill(live, range(0, 40))
        _age(live.dir)
        s = _store(tmp_path, c)
        try:
            fill(s, range(100, 160))
            assert readable(live, range(0, 40)) == 40
            assert directory_bytes(tmp_path) <= SIZE
            assert 0 < readable(s, range(100, 160)) < 60
            assert readable(s, range(150, 160)) == 10  # its newest stay
            assert s.stats.evicted_blocks > 0
        finally:
            s.close()
    finally:
        live.close()


def test_start_prunes_orphans_and_keeps_everything_else(tmp_path):
    a, b, c = FPS
    s = _store(tmp_path, a)
    fill(s, range(10))
    s.close()
    own = s.dir
    (own / "manifest.json").unlink()  # a crash's segments: no manifest, still valid
    (own / ".manifest-99999.tmp").write_text("{}")  # a crash while saving the manifest
    (own / "00000000000000000001-1-deadbeef.kvs").write_bytes(b"")  # a crash before its header
    (own / "00000000000000000002-1-deadbeef.kvs").write_bytes(b"junk" * 20)  # not a segment
    (tmp_path / ".probe-1-abcd").write_text("x")  # a crash while probing the directory
    orphan_fp = tmp_path / f"kv-{b.hex()[:24]}"  # another configuration's, segments all gone
    orphan_fp.mkdir()
    (orphan_fp / "manifest.json").write_text('{"block_bytes": 1000, "segments": {}}')
    (orphan_fp / "evict.lock").write_text("")
    for d in (tmp_path, own, orphan_fp):
        _age(d)
    fresh = own / ".manifest-88888.tmp"  # another server saving its manifest right now
    fresh.write_text("{}")
    mine = tmp_path / "notes.txt"  # not kvserve's: never touched
    mine.write_text("keep me")
    foreign = tmp_path / "kv-backup"  # not a fingerprint directory's name: never touched
    foreign.mkdir()
    (foreign / "x.kvs").write_bytes(b"")
    _age(foreign)
    s = _store(tmp_path, a)  # today: nothing is pruned
    try:
        names = {p.name for p in own.iterdir()}
        assert ".manifest-99999.tmp" not in names
        assert "00000000000000000001-1-deadbeef.kvs" not in names
        assert "00000000000000000002-1-deadbeef.kvs" not in names
        assert not (tmp_path / ".probe-1-abcd").exists()
        assert not orphan_fp.exists()
        assert fresh.exists() and mine.read_text() == "keep me"
        assert (foreign / "x.kvs").exists()
        assert len(s) == 10 and readable(s, range(10)) == 10
        assert s.stats.pruned_files >= 5
    finally:
        s.close()


def test_start_evicts_a_directory_over_a_lowered_size(tmp_path):
    """A restart with a smaller --kv-disk-size: the directory is brought under it at start,
    the other fingerprint first."""
    a, b = FPS[:2]
    for fp, ids in ((a, range(0, 40)), (b, range(40, 80))):
        s = _store(tmp_path, fp)
        fill(s, ids)
        s.close()
    _age(tmp_path / f"kv-{a.hex()[:24]}")
    small = 32 * 1024
    s = _store(tmp_path, b, size=small)
    try:
        assert directory_bytes(tmp_path) <= small
        assert _segments(tmp_path, a) == set()
        assert 0 < len(s) <= 40
    finally:
        s.close()
