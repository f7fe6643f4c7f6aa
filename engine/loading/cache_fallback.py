"""When the model cache cannot be written (read-only, full disk, not a directory): one clear
log line naming the directory and ``$KVSERVE_CACHE_DIR`` (what moves it), and the GGUF served
directly instead of a raw traceback.

The fallback conversion writes no weights: only the config, tokenizer and marker files (a few
hundred KB) go into a temporary directory, removed at exit, and every tensor is read from the
GGUF at load (:func:`engine.loading.gguf_convert.iter_gguf_tensors`), as for a conversion that
left its packed tensors in the GGUF. Nothing is cached: the next start does the same again.
"""

from __future__ import annotations

import atexit
import errno
import logging
import shutil
import tempfile
from pathlib import Path

from engine import envs
from engine.loading import gguf_convert

logger = logging.getLogger("kvserve.loader")

CACHE_VARIABLE = envs.CACHE_DIR
_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT,
               errno.ENOTDIR, errno.EEXIST}
# Writers that report the OS error only in their message (safetensors' Rust writer).
_MESSAGES = ("No space left", "Read-only file system", "Permission denied", "os error 28",
             "StorageFull", "Disk quota")


def cache_write_error(exc: BaseException) -> str | None:
    """Why ``exc`` (or an exception it was raised from) means the cache cannot be written, or
    None when it is some other failure (a bad GGUF: not ours to hide)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _UNWRITABLE:
            return current.strerror or str(current)
        if any(m in str(current) for m in _MESSAGES):
            return str(current).splitlines()[0][:200]
        current = current.__cause__ or current.__context__
    return None


def converted_or_direct(gguf: Path, target: Path, cache_root: Path,
                        progress: bool | None) -> Path:
    """``ensure_converted(gguf, target)``; when the cache cannot be written, a weightless
    conversion in a temporary directory instead (see the module docstring)."""
    try:
        return gguf_convert.ensure_converted(gguf, target, progress=progress)
    except Exception as exc:  # noqa: BLE001 - only cache-write failures are handled
        why = cache_write_error(exc)
        if why is None:
            raise
    logger.warning("cannot write the model cache %s (%s): serving %s directly from the GGUF "
                   "(nothing cached; each start reads it again). Set %s to a writable "
                   "directory with room for the converted model to cache it.", cache_root, why,
                   gguf.name, CACHE_VARIABLE)
    try:
        tmp = Path(tempfile.mkdtemp(prefix="kvserve-gguf-"))
    except OSError as exc:
        raise ValueError(f"cannot write the model cache {cache_root} ({why}), nor a temporary "
                         f"directory ({exc.strerror}): set {CACHE_VARIABLE} to a writable "
                         f"directory") from None
    atexit.register(shutil.rmtree, tmp, True)
    try:
        gguf_convert.convert_gguf(gguf, tmp, progress=progress, weights_in_gguf=True)
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(tmp, ignore_errors=True)
        why_tmp = cache_write_error(exc)
        if why_tmp is None:
            raise
        raise ValueError(f"cannot write the model cache {cache_root} ({why}), nor the "
                         f"temporary directory {tmp} ({why_tmp}): set {CACHE_VARIABLE} to a "
                         f"writable directory") from None
    return tmp
