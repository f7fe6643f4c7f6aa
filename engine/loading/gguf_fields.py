"""Reading one metadata value of a GGUF file (``gguf``'s ``GGUFReader``)."""

from __future__ import annotations

from typing import Any


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The value under ``key`` (a str, a number, or a list for array fields), or ``default``
    when the file does not have it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
