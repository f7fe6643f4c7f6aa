"""How large an image a request may send, and the error for one that cannot be used: kept
apart from the decoding (engine/vision/images.py) so that what reads options (the server's
command line) imports neither torch nor Pillow."""

from __future__ import annotations

from dataclasses import dataclass


class ImageError(ValueError):
    """An image a request sent cannot be used; the message names what is wrong with it."""


@dataclass(frozen=True)
class ImageLimits:
    """How large an image a request may send: ``max_bytes`` of encoded data and
    ``max_pixels`` of declared width x height (both positive ints)."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ImageLimits.{name} must be a positive int, got {value!r}")
