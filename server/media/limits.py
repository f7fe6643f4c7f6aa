"""``MediaSettings``: where a request's images may come from, and how many and how large.

The options are vLLM's: ``--allowed-local-media-path`` (``allowed_local_media_path``: the
directories ``file://`` URLs may read under; none: every ``file://`` URL is refused),
``--allowed-media-domains`` (``allowed_media_domains``: the hosts ``http(s)://`` URLs may be
fetched from; none: every such URL is refused) and ``--limit-mm-per-prompt '{"image": N}'``
(``max_images_per_request``). ``image_limits`` bounds each image's encoded bytes and declared
pixels (engine/vision/images.py). Construction validates and normalises: directories are made
absolute with symlinks resolved and must exist, domains are lower-cased host names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.json_object import json_text
from engine.vision.limits import ImageLimits

DEFAULT_MAX_IMAGES = 4
MODALITIES = ("image",)


@dataclass(frozen=True)
class MediaSettings:
    """See the module's docstring. ``fetch_timeout`` is the seconds one ``http(s)`` fetch may
    take, connecting and reading (positive)."""

    allowed_local_media_path: tuple[str, ...] = ()
    allowed_media_domains: tuple[str, ...] = ()
    max_images_per_request: int = DEFAULT_MAX_IMAGES
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    fetch_timeout: float = 10.0

    def __post_init__(self) -> None:
        paths = _strings(self.allowed_local_media_path, "allowed-local-media-path")
        resolved = []
        for p in paths:
            path = Path(p).expanduser()
            if not path.is_absolute():
                raise ValueError(f"allowed-local-media-path must be absolute directories; got "
                                 f"{p!r}")
            if not path.is_dir():
                raise ValueError(f"allowed-local-media-path {p!r} is not an existing directory")
            resolved.append(str(path.resolve()))
        object.__setattr__(self, "allowed_local_media_path", tuple(resolved))
        domains = []
        for d in _strings(self.allowed_media_domains, "allowed-media-domains"):
            host = d.strip().lower().rstrip(".")
            if not host or any(c in host for c in "/:@ ?#"):
                raise ValueError(f"allowed-media-domains takes host names (e.g. "
                                 f"images.example.com, no scheme, port or path); got {d!r}")
            domains.append(host)
        object.__setattr__(self, "allowed_media_domains", tuple(domains))
        n = self.max_images_per_request
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"the image limit of --limit-mm-per-prompt must be an integer "
                             f">= 0; got {n!r}")
        if not isinstance(self.image_limits, ImageLimits):
            raise ValueError(f"image_limits must be an ImageLimits; got "
                             f"{type(self.image_limits).__name__}")
        if not (isinstance(self.fetch_timeout, (int, float)) and self.fetch_timeout > 0):
            raise ValueError(f"fetch_timeout must be a positive number of seconds; got "
                             f"{self.fetch_timeout!r}")


def _strings(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of strings; got {value!r}")
    return tuple(value)


def parse_limit_mm(value: Mapping[str, Any] | str | None) -> int:
    """The images per request of ``--limit-mm-per-prompt`` (JSON text or a mapping, e.g.
    ``{"image": 4}``); ``DEFAULT_MAX_IMAGES`` when None or when it leaves ``image`` out.
    ``ValueError`` for anything else: not JSON, not an object, another modality, not an
    integer >= 0."""
    if value is None:
        return DEFAULT_MAX_IMAGES
    value = json_text(value, "limit-mm-per-prompt", '{"image": 4}')
    if not isinstance(value, Mapping):
        raise ValueError(f"limit-mm-per-prompt must be a JSON object such as {{\"image\": 4}}; "
                         f"got {value!r}")
    other = sorted(str(k) for k in value if k not in MODALITIES)
    if other:
        raise ValueError(f"limit-mm-per-prompt: only images are served here; got "
                         f"{', '.join(other)}")
    n = value.get("image", DEFAULT_MAX_IMAGES)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"limit-mm-per-prompt: image must be an integer >= 0; got {n!r}")
    return n
