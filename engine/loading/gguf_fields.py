"""Reading a GGUF file's metadata and tensor table (``gguf``'s ``GGUFReader``), parsed once.

``GGUFReader`` parses every metadata field when it opens a file (a tokenizer's ~100k strings
as numpy views: seconds, and more on a busy machine), and one start reads the same file for
its architecture, config, tensors, pooling type, sampling defaults and chat template.
:func:`gguf_reader` keeps the last file's reader (one file at a time, keyed by its path, size
and modification time); :func:`release_gguf_readers` drops it once the model is loaded.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

_LOCK = threading.Lock()
_READERS: dict[tuple[str, int, int], Any] = {}


def gguf_reader(path: str | Path):
    """A ``GGUFReader`` of ``path``: the one already parsed if the file has not changed."""
    from gguf import GGUFReader

    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    with _LOCK:
        reader = _READERS.get(key)
        if reader is None:
            _READERS.clear()  # one file at a time: its parsed fields take memory
            reader = _READERS[key] = GGUFReader(str(p))
        return reader


def release_gguf_readers() -> None:
    """Drop the kept reader (its parsed fields; tensors taken from it keep their own data)."""
    with _LOCK:
        _READERS.clear()


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The value under ``key`` (a str, a number, or a list for array fields), or ``default``
    when the file does not have it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
