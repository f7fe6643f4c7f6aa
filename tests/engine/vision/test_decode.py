"""decode_image on hostile bytes: each is refused with ImageError naming the fault, a huge
declared size before any pixel is decoded; ImageLimits is validated; image_hash keys images by
their pixels."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from engine.vision.images import ImageError, ImageLimits, decode_image, hash_image, image_hash


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _noise(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8), mode=mode)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose IHDR (valid CRC) declares ``width`` x ``height`` RGB, with a few bytes of
    pixel data: a decompression bomb's header without the bomb."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _chunk(b"IEND", b""))


@pytest.fixture
def loads(monkeypatch):
    """Records every pixel decode (ImageFile.load) that happens during the test."""
    calls = []
    real = ImageFile.ImageFile.load

    def load(self):
        calls.append(self.size)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


@pytest.mark.parametrize("fmt, mode", [("PNG", "RGBA"), ("JPEG", "RGB"), ("WEBP", "RGB"),
                                       ("GIF", "RGB"), ("PNG", "L")])
def test_good_images_decode(fmt, mode):
    image = _noise(37, 21, "RGB").convert(mode)
    decoded = decode_image(_encode(image, fmt))
    assert decoded.size == (37, 21) and decoded.format == fmt
    if fmt == "PNG":  # lossless
        assert decoded.mode == mode and decoded.tobytes() == image.tobytes()


def test_random_bytes_are_not_an_image():
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    with pytest.raises(ImageError, match="not a PNG, JPEG, WEBP or GIF image"):
        decode_image(data)


def test_other_formats_are_not_opened():
    """BMP and TIFF are images Pillow reads, but no request may reach their decoders."""
    for fmt in ("BMP", "TIFF"):
        with pytest.raises(ImageError, match="not a PNG, JPEG, WEBP or GIF image"):
            decode_image(_encode(_noise(8, 8), fmt))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_images_are_refused(fmt, loads):
    data = _encode(_noise(64, 64), fmt)
    decode_image(data)  # whole, it is fine
    with pytest.raises(ImageError, match=f"truncated or corrupt \\({fmt} 64x64\\)"):
        decode_image(data[: len(data) // 2])
    assert loads  # the header was fine: the failure came from the pixel data


def test_a_huge_declared_size_is_refused_before_decoding(loads):
    data = declared_png(20000, 20000)
    assert len(data) < 4096
    start = time.perf_counter()
    with pytest.raises(ImageError, match="too many pixels"):
        decode_image(data)
    assert time.perf_counter() - start < 0.5
    assert loads == []


def test_our_pixel_limit_is_checked_on_the_header(loads):
    # 64 megapixels: under Pillow's own bomb check, over the default limit.
    with pytest.raises(ImageError, match="8000x8000 = 64000000 pixels, over the limit of 40000000"):
        decode_image(declared_png(8000, 8000))
    with pytest.raises(ImageError, match="100x100 = 10000 pixels, over the limit of 5000"):
        decode_image(declared_png(100, 100), ImageLimits(max_pixels=5000))
    assert loads == []
    # The hook does see a decode when one happens (this one fails: the data is missing).
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(declared_png(300, 300))
    assert loads == [(300, 300)]


def test_too_many_bytes_are_refused_before_parsing():
    data = _encode(_noise(16, 16), "PNG")
    limits = ImageLimits(max_bytes=len(data) - 1)
    with pytest.raises(ImageError, match=f"{len(data)} bytes, over the limit of {len(data) - 1}"):
        decode_image(data, limits)
    with pytest.raises(ImageError, match="over the limit of 10"):
        decode_image(b"\0" * 11, ImageLimits(max_bytes=10))
    decode_image(data, ImageLimits(max_bytes=len(data)))


def test_empty_and_non_bytes_are_refused():
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")
    with pytest.raises(ImageError, match="must be bytes, got str"):
        decode_image("iVBORw0KGgo=")
    assert issubclass(ImageError, ValueError)


@pytest.mark.parametrize("kwargs", [dict(max_bytes=0), dict(max_pixels=-1), dict(max_bytes=True),
                                    dict(max_pixels=1.5), dict(max_bytes="20MiB")])
def test_limits_refuse_nonsense(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"ImageLimits.{name} must be a positive int"):
        ImageLimits(**kwargs)


def test_limits_defaults():
    limits = ImageLimits()
    assert limits.max_bytes == 20 * 1024 * 1024 and limits.max_pixels == 40_000_000


def test_image_hash_keys_the_pixels():
    image = _noise(20, 10, "RGBA")
    data = _encode(image, "PNG")
    key = image_hash(data)
    assert len(key) == 64 and key == image_hash(data)
    # The same pixels encoded differently: one key.
    assert image_hash(_encode(image, "PNG", compress_level=0)) == key
    # One pixel changed: another key.
    changed = image.copy()
    r, g, b, a = changed.getpixel((3, 4))
    changed.putpixel((3, 4), ((r + 1) % 256, g, b, a))
    assert image_hash(_encode(changed, "PNG")) != key
    # The same bytes of pixels in another shape: another key.
    assert hash_image(Image.frombytes("RGB", (10, 20), image.convert("RGB").tobytes())) != \
        hash_image(image.convert("RGB"))
    # Colours under full transparency are invisible to the model, and to the key.
    clear_red = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    clear_blue = Image.new("RGBA", (4, 4), (0, 0, 255, 0))
    assert image_hash(_encode(clear_red, "PNG")) == image_hash(_encode(clear_blue, "PNG"))
    with pytest.raises(ImageError):
        image_hash(b"not an image")
