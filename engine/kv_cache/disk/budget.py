"""The whole ``--kv-disk-dir`` under ``--kv-disk-size``: every fingerprint's sub-directory counts.

Layout: ``DIR/kv-<24 hex digits>/`` per fingerprint (its segments ``*.kvs``, ``manifest.json``,
``in-use.lock``), and ``DIR/kv-evict.lock``, which keeps the servers sharing ``DIR`` from
evicting or pruning at once. Only what kvserve makes is counted or ever deleted: sub-directories
named ``kv-`` and 24 hex digits, and the files in them; anything else in ``DIR`` is left alone.

A store holds a shared ``flock`` on its fingerprint's ``in-use.lock`` for its whole life
(:func:`hold_in_use`); another fingerprint is evicted from only while nobody holds that lock,
and a segment only while no writer holds its own ``flock``. :func:`evict_others` takes other
fingerprints first, least recently used first, each one's segments oldest first;
:func:`prune_orphans` removes, at start, files nobody holds or touched for ``PRUNE_AGE_S``
(their rules are on each function)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.kv_cache.disk.segment import HEADER_BYTES, SUFFIX, header_problem

logger = logging.getLogger("kvserve.engine")

IN_USE = "in-use.lock"
EVICT_LOCK = "kv-evict.lock"
PRUNE_AGE_S = 300.0  # far longer than a file stays temporary (a probe, a manifest being saved)
_FP_DIR = re.compile(r"kv-[0-9a-f]{24}")
_TEMP = re.compile(r"(\.manifest-.*\.tmp|\.probe-.*)")


@dataclass(frozen=True)
class _File:
    path: Path
    size: int
    mtime: float


def fingerprint_dirs(base: Path) -> list[Path]:
    """The fingerprint sub-directories of ``base`` (none when it cannot be listed)."""
    try:
        return [Path(e.path) for e in os.scandir(base)
                if _FP_DIR.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _files(d: Path) -> list[_File]:
    out = []
    try:
        for e in os.scandir(d):
            try:
                if e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    out.append(_File(Path(e.path), st.st_size, st.st_mtime))
            except OSError:  # deleted meanwhile
                continue
    except OSError:
        pass
    return out


def directory_bytes(base: Path) -> int:
    """Bytes of every file in ``base``'s fingerprint sub-directories (every server's)."""
    return sum(f.size for d in fingerprint_dirs(Path(base)) for f in _files(d))


def held(path: Path) -> bool:
    """Another open file holds a ``flock`` on ``path`` (a writer, a live store)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


# ---- a store's claim on its fingerprint directory ----------------------------------------
def hold_in_use(fp_dir: Path) -> int:
    """Create ``fp_dir`` if needed and hold a shared lock on its ``in-use.lock`` (the fd,
    to keep open while the store lives). Raises ``OSError``. An evictor that removed the
    directory between our ``mkdir`` and our lock leaves us an unlinked file: then again."""
    for _ in range(5):
        fp_dir.mkdir(parents=True, exist_ok=True)
        path = fp_dir / IN_USE
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                os.utime(fd)
                return fd
        except FileNotFoundError:
            pass
        except OSError:
            os.close(fd)
            raise
        os.close(fd)
    raise FileNotFoundError(f"{fp_dir} keeps disappearing")


def release_in_use(fd: int) -> None:
    """Mark the fingerprint used now (its last use, for eviction order) and let it go."""
    with contextlib.suppress(OSError):
        os.utime(fd)
    os.close(fd)


def evict_lock(base: Path) -> contextlib.AbstractContextManager[bool]:
    """Yields True while this process alone evicts or prunes in ``base``; False (do nothing)
    when another one is at it, or the lock cannot be had."""
    return _exclusive(Path(base) / EVICT_LOCK, os.O_CREAT | os.O_RDWR, missing=False)


def _unused(fp_dir: Path) -> contextlib.AbstractContextManager[bool]:
    """Yields True, holding ``fp_dir``'s ``in-use.lock`` exclusively, when no store uses it
    (also when it has no such lock file); False otherwise."""
    return _exclusive(fp_dir / IN_USE, os.O_RDONLY, missing=True)


@contextlib.contextmanager
def _exclusive(path: Path, flags: int, missing: bool) -> Iterator[bool]:
    """Yields whether an exclusive non-blocking ``flock`` on ``path`` (opened with ``flags``)
    is held; ``missing``: what a file that does not exist yields."""
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        yield missing
        return
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove_dir(fp_dir: Path) -> int:
    """Delete what is left of an unused fingerprint directory with no segment (its manifest,
    locks) and the directory; returns the files deleted. Call inside ``_unused``."""
    n = 0
    for f in _files(fp_dir):
        with contextlib.suppress(OSError):
            f.path.unlink()
            n += 1
    with contextlib.suppress(OSError):
        fp_dir.rmdir()  # a store that started meanwhile made a new file: it stays
    return n


# ---- eviction of other fingerprints --------------------------------------------------------
@dataclass
class Evicted:
    bytes: int = 0
    segments: int = 0
    directories: int = 0


def evict_others(base: Path, own: Path, need: int) -> Evicted:
    """Free at least ``need`` bytes from fingerprints other than ``own`` that no store uses,
    least recently used first (the newest modification time of their files: segments are
    appended to, ``in-use.lock`` is touched when a store opens and closes), each one's segments
    oldest first, its directory removed once no segment is left; a fingerprint only while
    nobody holds its ``in-use.lock``, a segment only while no writer holds its ``flock`` (a
    server too old to take ``in-use.lock`` loses at most closed segments). Less when there is
    not that much. The caller then evicts its own least recently used segments.
    Call under :func:`evict_lock`."""
    out = Evicted()
    others = []
    for d in fingerprint_dirs(base):
        if d != own:
            files = _files(d)
            others.append((max((f.mtime for f in files), default=0.0), d, files))
    for _, d, files in sorted(others, key=lambda t: (t[0], t[1].name)):
        if out.bytes >= need:
            break
        with _unused(d) as free:
            if not free:
                continue
            segments = sorted((f for f in files if f.path.name.endswith(SUFFIX)),
                              key=lambda f: (f.mtime, f.path.name))
            left = len(segments)
            for f in segments:
                if out.bytes >= need or held(f.path):
                    break
                with contextlib.suppress(FileNotFoundError):
                    f.path.unlink()
                    out.bytes += f.size
                    out.segments += 1
                left -= 1
            if left == 0:
                rest = [f for f in _files(d) if f.path.name != IN_USE]
                out.bytes += sum(f.size for f in rest)
                _remove_dir(d)
                out.directories += 1
                logger.info("kv disk tier: evicted %s, another configuration's blocks "
                            "(least recently used), to keep %s under --kv-disk-size",
                            d.name, base)
    return out


# ---- orphans -------------------------------------------------------------------------------
def _orphan_reason(f: _File, fp_hex: str) -> str | None:
    name = f.path.name
    if _TEMP.fullmatch(name):
        return "a temporary file"
    if not name.endswith(SUFFIX):
        return None
    try:
        with open(f.path, "rb") as fh:
            header = fh.read(HEADER_BYTES)
    except OSError:
        return None
    return header_problem(header, fp_hex)


def prune_orphans(base: Path, now: float | None = None) -> list[Path]:
    """Delete the orphans of ``base`` and return them: files nobody holds and nobody touched for
    ``PRUNE_AGE_S``: temporary files (``.manifest-*.tmp``, ``.probe-*``), segment files without
    a valid header (shorter than one, not a segment's magic, or naming another fingerprint than
    their directory), and fingerprint directories left with no segment (not in use). A segment
    missing from the manifest is no orphan: the manifest is a start-up shortcut a crash never
    writes. Call under
    :func:`evict_lock`; ``now``: wall-clock seconds (file times are compared with it)."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    for f in _files(base):
        if _TEMP.fullmatch(f.path.name) and now - f.mtime > PRUNE_AGE_S:
            with contextlib.suppress(OSError):
                f.path.unlink()
                removed.append(f.path)
    for d in fingerprint_dirs(base):
        fp_hex = d.name[3:]
        files = _files(d)
        for f in files:
            if now - f.mtime <= PRUNE_AGE_S or f.path.name == IN_USE:
                continue
            why = _orphan_reason(f, fp_hex)
            if why is not None and not held(f.path):
                with contextlib.suppress(OSError):
                    f.path.unlink()
                    removed.append(f.path)
                    logger.debug("kv disk tier: removed %s (%s, untouched for %.0f s)",
                                f.path, why, now - f.mtime)
        left = _files(d)
        if any(f.path.name.endswith(SUFFIX) for f in left):
            continue
        try:
            newest = max(f.mtime for f in left) if left else d.stat().st_mtime
        except OSError:
            continue
        if now - newest <= PRUNE_AGE_S:
            continue
        with _unused(d) as free:
            if free:
                removed += [f.path for f in left]
                _remove_dir(d)
                logger.debug("kv disk tier: removed %s (no segment left, unused)", d)
    return removed
