"""``kvserve cache ls|prune``: what the cache directory holds and how to shrink it.

The cache (``$KVSERVE_CACHE_DIR``, else ``~/.cache/kvserve``) holds ``models/<stem>-<key>/``
(GGUF files converted into Hugging Face directories, :mod:`engine.loading.gguf_convert`, one per
GGUF content and converter format, shared by every venv and checkout; the big part; last use the
mtime of ``kvserve-last-use``, touched at each start that uses them), ``cpu-kernels/`` (the
compiled CPU kernels) and ``quant-probe/`` (the start-up probe's verdicts).

:func:`prune` removes converted models only: with no option, those no kvserve of this version
reads (an older format or key, interrupted conversions' leftovers); ``older_than_days`` also
those unused for that long; ``everything`` all of them. A removed model is converted again on
its next use; the kernels and verdicts are left."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from engine.loading import gguf_convert


@dataclass(frozen=True)
class Entry:
    """One item of the cache: a converted model, a leftover, or another of its folders."""

    path: Path
    kind: str  # "model", "stale model" (older format), "leftover", or the folder's name
    size: int  # bytes
    last_use: float  # epoch seconds
    source: str = ""  # the GGUF it was converted from (as recorded), for models


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def _model_entry(path: Path) -> Entry:
    marker = path / gguf_convert.MARKER
    last_use_file = path / gguf_convert.LAST_USE
    stamp = next((p for p in (last_use_file, marker, path) if p.exists()), path)
    last_use = stamp.stat().st_mtime
    if path.name.startswith(".") or not marker.is_file():
        return Entry(path, "leftover", _size(path), last_use)
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        info = {}
    current = (info.get("format") == gguf_convert.CONVERSION_FORMAT
               and path.name.endswith(f"-{info.get('key', '')}") and info.get("key"))
    return Entry(path, "model" if current else "stale model", _size(path), last_use,
                 str(info.get("source", "")))


def entries(cache_root: Path) -> list[Entry]:
    """Everything in ``cache_root``: the converted models (and leftovers) one by one, then
    each other folder as a whole. Lock files are left out."""
    found: list[Entry] = []
    models = cache_root / "models"
    if models.is_dir():
        for path in sorted(models.iterdir()):
            if path.is_dir():
                found.append(_model_entry(path))
    if cache_root.is_dir():
        for path in sorted(cache_root.iterdir()):
            if path.name != "models" and path.is_dir():
                found.append(Entry(path, path.name, _size(path), path.stat().st_mtime))
    return found


def prune(cache_root: Path, *, older_than_days: float | None = None,
          everything: bool = False, dry_run: bool = False) -> list[Entry]:
    """Remove converted models (see the module docstring); returns what was (or, with
    ``dry_run``, would be) removed."""
    now = time.time()
    removed = []
    for entry in entries(cache_root):
        if entry.kind not in ("model", "stale model", "leftover"):
            continue
        old = (older_than_days is not None
               and now - entry.last_use > older_than_days * 86400)
        if everything or old or entry.kind != "model":
            removed.append(entry)
            if not dry_run:
                shutil.rmtree(entry.path, ignore_errors=True)
                (entry.path.parent / f".{entry.path.name}.lock").unlink(missing_ok=True)
    return removed


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _ago(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 86400 * 2:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def format_listing(cache_root: Path, found: list[Entry]) -> str:
    """``kvserve cache ls``'s table: size, last use, kind and path (source for models)."""
    now = time.time()
    lines = [f"{cache_root} ({human_size(sum(e.size for e in found))} in all)"]
    if not found:
        lines.append("  (empty)")
    for e in found:
        where = e.path.name if e.path.parent.name == "models" else e.path.name + "/"
        source = f"  <- {e.source}" if e.source else ""
        lines.append(f"  {human_size(e.size):>9}  {_ago(now - e.last_use):>13}  "
                     f"{e.kind:<11}  {where}{source}")
    return "\n".join(lines)
