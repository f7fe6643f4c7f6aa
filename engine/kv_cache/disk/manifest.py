"""``manifest.json``: a start-up shortcut, written at close, never trusted beyond file sizes.

It lists, per segment, the end offset the writer's index reached and each record's (hash,
offset). :func:`load_manifest` keeps only segments whose file size is exactly that end and
whose header is this fingerprint's; anything else is scanned. Records are still verified on
every read, so a wrong manifest can cost a miss, never a wrong block. Deleting it is harmless.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.kv_cache.disk.segment import HEADER_BYTES, SUFFIX, segment_header

NAME = "manifest.json"

Segments = dict[str, tuple[int, list[tuple[bytes, int]]]]  # name -> (end, [(hash, offset)])


def save_manifest(directory: Path, block_bytes: int, segments: Segments) -> None:
    """Atomically replace ``directory/manifest.json`` (best effort: errors are ignored)."""
    data = {name: [end, [[h.hex(), off] for h, off in records]]
            for name, (end, records) in segments.items()}
    tmp = directory / f".manifest-{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"block_bytes": block_bytes, "segments": data}))
        os.replace(tmp, directory / NAME)
    except OSError:
        pass


def load_manifest(directory: Path, fingerprint: bytes, block_bytes: int) -> Segments:
    """The manifest's segments that still match their files (empty when there is none, it
    is unreadable, or it was written for another block size)."""
    out: Segments = {}
    try:
        data = json.loads((directory / NAME).read_text())
        if data.get("block_bytes") != block_bytes:
            return {}
        for name, (end, records) in data["segments"].items():
            path = directory / name
            if not name.endswith(SUFFIX) or "/" in name or path.stat().st_size != end:
                continue
            with open(path, "rb") as f:
                if f.read(HEADER_BYTES) != segment_header(fingerprint):
                    continue
            out[name] = (int(end), [(bytes.fromhex(h), int(off)) for h, off in records])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return out
