"""Image bytes from a request to the pixel tensor Gemma 3's vision tower takes.

``decode_image(data, limits)`` turns untrusted bytes into a loaded ``PIL.Image`` or raises
``ImageError`` (a ``ValueError``) saying what is wrong: no bytes, more bytes than
``limits.max_bytes``, a format outside ``ALLOWED_FORMATS``, not an image at all, a declared
width x height above ``limits.max_pixels`` (read from the header and refused before any pixel is
decoded or allocated), or pixel data that is truncated or corrupt. Only PNG, JPEG, WEBP and
GIF (its first frame) are opened, so none of Pillow's other decoders ever sees request bytes.

``preprocess(images, config)`` is HF's Gemma 3 image processor with its defaults (pan and
scan off): transparency composited onto white and the image converted to RGB, resized to
``image_size`` x ``image_size`` with Pillow's bilinear filter (aspect ratio not kept, no EXIF
rotation), scaled by 1/255 and normalised with the config's mean and std, as float32
``[B, 3, image_size, image_size]``.

``image_hash`` keys an image by content: see its docstring for what is hashed and why.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from engine.vision.config import VisionConfig
from engine.vision.limits import ImageError, ImageLimits

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_RESCALE = 1 / 255


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """The decoded image of ``data`` (pixels loaded, mode as stored), or ``ImageError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"image data must be bytes, got {type(data).__name__}")
    size = len(data)
    if size == 0:
        raise ImageError("image data is empty (0 bytes)")
    if size > limits.max_bytes:
        raise ImageError(f"image data is {size} bytes, over the limit of {limits.max_bytes}")
    try:
        # Reads the header only: the size is known, no pixel is decoded yet.
        image = Image.open(io.BytesIO(bytes(data)), formats=ALLOWED_FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError(f"image declares too many pixels (limit {limits.max_pixels}): {e}") from e
    except UnidentifiedImageError as e:
        raise ImageError("image data is not a PNG, JPEG, WEBP or GIF image") from e
    except Exception as e:  # noqa: BLE001 - any decoder failure is the bytes' fault
        raise ImageError(f"image header is corrupt: {e}") from e
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(f"image declares an empty size {width}x{height}")
    if width * height > limits.max_pixels:
        raise ImageError(f"image declares {width}x{height} = {width * height} pixels, over the "
                         f"limit of {limits.max_pixels}")
    try:
        image.load()
    except Exception as e:  # noqa: BLE001 - truncated data is OSError, broken chunks others
        raise ImageError(f"image data is truncated or corrupt ({image.format} "
                         f"{width}x{height}): {e}") from e
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as RGB; where it has transparency (an alpha band or a transparent colour),
    composited over opaque white first, as HF's ``convert_to_rgb`` does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(images: Sequence[Image.Image], config: VisionConfig) -> torch.Tensor:
    """Float32 ``[len(images), 3, image_size, image_size]``, HF's Gemma 3 processor's
    ``pixel_values`` for these images. ``ValueError`` for an empty sequence."""
    if isinstance(images, Image.Image):
        images = [images]
    if len(images) == 0:
        raise ValueError("preprocess needs at least one image")
    side = config.image_size
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    out = []
    for image in images:
        resized = to_rgb(image).resize((side, side), Image.Resampling.BILINEAR)
        # [H, W, 3] uint8 -> [0, 1] (scaled in float64, then float32, as HF does) -> normalised.
        pixels = (np.asarray(resized).astype(np.float64) * _RESCALE).astype(np.float32)
        out.append(((pixels - mean) / std).transpose(2, 0, 1))
    return torch.from_numpy(np.ascontiguousarray(np.stack(out)))


def hash_image(image: Image.Image) -> str:
    """sha256 hex of the image's RGB pixels (``to_rgb``) and its width and height."""
    rgb = to_rgb(image)
    digest = hashlib.sha256(b"kvserve-image-rgb8\0")
    digest.update(rgb.width.to_bytes(4, "little") + rgb.height.to_bytes(4, "little"))
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def image_hash(data: bytes, limits: ImageLimits = ImageLimits()) -> str:
    """The content key of an encoded image: ``hash_image`` of ``decode_image(data, limits)``.

    The decoded pixels are hashed, not the bytes, because the key stands for what the model
    sees: the same picture re-encoded (another PNG compression level, stripped metadata, a
    different hidden colour under full transparency) maps to one key, so the encoder and prefix
    caches it will key share the work. The price is a decode before a cache lookup, which the
    request needs anyway, and it means the key is only defined for bytes that decode
    (``ImageError`` otherwise)."""
    return hash_image(decode_image(data, limits))
