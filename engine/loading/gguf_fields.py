"""Reading a GGUF file's metadata and tensor table (``gguf``'s ``GGUFReader``, slicing a plain
view of its memory map), parsed once.

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


def _reader_class():
    """``GGUFReader`` slicing a plain ndarray view of its memory map instead of the
    ``np.memmap`` itself (each ``np.memmap`` slice runs memmap's Python-level
    ``__array_finalize__``, and a tokenizer's fields are ~10^6 slices: most of the parse), and
    reading arrays of strings or scalars in one pass instead of one recursive call per element.
    The parts, indices, types and tensors are the same bytes gguf-py gives, as plain ndarrays
    (still backed by the mapping)."""
    global _FAST_READER
    if _FAST_READER is None:
        import numpy as np
        from gguf import GGUFReader, GGUFValueType

        itemsizes: dict[Any, int] = {}

        class FastGGUFReader(GGUFReader):
            def _get(self, offset, dtype, count=1, override_order=None):
                plain = self.__dict__.get("_plain")
                if plain is None:
                    plain = self._plain = self.data.view(np.ndarray)
                count = int(count)
                size = itemsizes.get(dtype)
                if size is None:
                    size = itemsizes[dtype] = np.dtype(dtype).itemsize
                arr = plain[offset:offset + size * count].view(dtype)[:count]
                order = self.byte_order if override_order is None else override_order
                return arr.view(arr.dtype.newbyteorder(order))

            def _get_field_parts(self, orig_offs, raw_type):
                """An array of strings or scalars in one pass over its bytes, with the parts,
                indices and types gguf-py's element-by-element recursion gives."""
                if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                    return super()._get_field_parts(orig_offs, raw_type)
                raw_itype = self._get(orig_offs, np.uint32)
                alen = self._get(orig_offs + 4, np.uint64)
                itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
                nptype = self.gguf_scalar_to_np.get(itype)
                if itype != GGUFValueType.STRING and nptype is None:
                    return super()._get_field_parts(orig_offs, raw_type)  # nested arrays
                plain, offs = self._plain, orig_offs + 12
                parts: list[Any] = [raw_itype, alen]
                if nptype is not None:
                    size = np.dtype(nptype).itemsize
                    whole = plain[offs:offs + size * n].view(nptype)
                    parts += [whole[i:i + 1] for i in range(n)]
                    idxs, offs = list(range(2, 2 + n)), offs + size * n
                else:
                    raw = memoryview(plain)
                    for _ in range(n):
                        length = int.from_bytes(raw[offs:offs + 8], "little")
                        parts += [plain[offs:offs + 8].view(np.uint64),
                                  plain[offs + 8:offs + 8 + length]]
                        offs += 8 + length
                    idxs = list(range(3, 3 + 2 * n, 2))
                return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY] + [itype] * bool(n)

        _FAST_READER = FastGGUFReader
    return _FAST_READER


_FAST_READER = None


def gguf_reader(path: str | Path):
    """A ``GGUFReader`` of ``path``: the one already parsed if the file has not changed."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    with _LOCK:
        reader = _READERS.get(key)
        if reader is None:
            _READERS.clear()  # one file at a time: its parsed fields take memory
            reader = _READERS[key] = _reader_class()(str(p))
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
