"""Image bytes for the media tests: a valid PNG, a truncated one, one whose header declares
20000 x 20000 pixels (with no pixel data), and data: URLs of them."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def png(width: int = 8, height: int = 6, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def truncated_png() -> bytes:
    data = png(64, 64, (1, 2, 3))
    return data[: len(data) // 2]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(
        ">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def huge_header_png(side: int = 20000) -> bytes:
    """A PNG signature and an IHDR declaring ``side`` x ``side`` RGB pixels, then an empty
    IDAT and IEND: a decompression bomb's header."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) +
            _chunk(b"IDAT", zlib.compress(b"")) + _chunk(b"IEND", b""))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
