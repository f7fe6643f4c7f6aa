"""``VisionConfig``: the shape of Gemma 3's image side, read from a HF ``Gemma3Config``.

One frozen dataclass holds what the SigLIP tower (``siglip.py``), the projector
(``projector.py``) and the preprocessing (``images.py``) need. Construction validates it and
raises ``ValueError`` naming the inconsistent values. ``from_hf`` reads a ``Gemma3Config`` (any
object with ``to_dict()``) or its ``config.json`` as a dict, without importing transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# SigLIP's constants that Gemma 3's config.json files leave out (SiglipVisionConfig's defaults).
_SIGLIP_DEFAULTS = {"layer_norm_eps": 1e-6, "num_channels": 3, "hidden_act": "gelu_pytorch_tanh"}
# The activations the tower implements: the tanh approximation of GELU, under HF's names.
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
# Gemma 3's image processor normalises with these (HF's IMAGENET_STANDARD_MEAN / _STD).
DEFAULT_IMAGE_MEAN = (0.5, 0.5, 0.5)
DEFAULT_IMAGE_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class VisionConfig:
    """Gemma 3's vision tower and projector, and the pixels they expect.

    ``image_size`` is the side of the square input in pixels, ``patch_size`` the side of one
    patch; the tower sees ``(image_size / patch_size) ** 2`` patches and the projector
    average-pools them to ``mm_tokens_per_image`` soft tokens (a square number), each of width
    ``text_hidden_size``. ``image_mean`` / ``image_std`` are per RGB channel, applied to pixels
    rescaled to [0, 1].
    """

    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    mm_tokens_per_image: int
    text_hidden_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3
    image_mean: tuple[float, float, float] = DEFAULT_IMAGE_MEAN
    image_std: tuple[float, float, float] = DEFAULT_IMAGE_STD

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "hidden_size", "intermediate_size",
                     "num_layers", "num_heads", "mm_tokens_per_image", "text_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"VisionConfig.{name} must be a positive int, got {value!r}")
        if self.num_channels != 3:
            raise ValueError(f"VisionConfig.num_channels must be 3 (RGB), got {self.num_channels!r}")
        if not (isinstance(self.layer_norm_eps, (int, float)) and 0 < self.layer_norm_eps < 1):
            raise ValueError(f"VisionConfig.layer_norm_eps must be in (0, 1), "
                             f"got {self.layer_norm_eps!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                             f"{self.num_heads}")
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square "
                             f"number (the tokens form a square grid)")
        if self.patches_per_side % side:
            raise ValueError(f"{self.patches_per_side} patches per side cannot be pooled evenly "
                             f"to {side} tokens per side (mm_tokens_per_image "
                             f"{self.mm_tokens_per_image}, image_size {self.image_size}, "
                             f"patch_size {self.patch_size})")
        for name in ("image_mean", "image_std"):
            value = tuple(getattr(self, name))
            if len(value) != 3 or not all(isinstance(v, (int, float)) for v in value):
                raise ValueError(f"VisionConfig.{name} must be 3 numbers (R, G, B), got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if not all(s > 0 for s in self.image_std):
            raise ValueError(f"VisionConfig.image_std must be positive, got {self.image_std!r}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def tokens_per_image(self) -> int:
        """The soft tokens one image becomes: the placeholders it takes in the prompt."""
        return self.mm_tokens_per_image

    @property
    def pool_kernel(self) -> int:
        """The side, in patches, of the square each soft token averages."""
        return self.patches_per_side // self.tokens_per_side

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, config: Any, *, image_mean=DEFAULT_IMAGE_MEAN,
                image_std=DEFAULT_IMAGE_STD) -> VisionConfig:
        """From a HF ``Gemma3Config`` (or anything with ``to_dict()``) or its ``config.json``
        dict. The mean and std live in the processor's config, not the model's: pass them when
        a checkpoint's ``preprocessor_config.json`` differs from Gemma 3's defaults.

        A key Gemma 3's files always carry that is missing raises ``ValueError`` naming it;
        SigLIP's fixed constants (layer-norm eps, 3 channels, the GELU-tanh activation) default
        as HF's ``SiglipVisionConfig`` does. An activation other than GELU-tanh is refused.
        """
        data = config.to_dict() if hasattr(config, "to_dict") else config
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a Gemma3Config or its dict, got {type(config).__name__}")
        vision = _section(data, "vision_config")
        text = _section(data, "text_config")
        act = vision.get("hidden_act", _SIGLIP_DEFAULTS["hidden_act"])
        if act not in GELU_TANH_NAMES:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported "
                             f"(the tower implements {GELU_TANH_NAMES[0]})")

        def need(section: Mapping, where: str, key: str):
            if key not in section or section[key] is None:
                raise ValueError(f"{where}{key} is missing from the config")
            return section[key]

        return cls(
            image_size=need(vision, "vision_config.", "image_size"),
            patch_size=need(vision, "vision_config.", "patch_size"),
            hidden_size=need(vision, "vision_config.", "hidden_size"),
            intermediate_size=need(vision, "vision_config.", "intermediate_size"),
            num_layers=need(vision, "vision_config.", "num_hidden_layers"),
            num_heads=need(vision, "vision_config.", "num_attention_heads"),
            layer_norm_eps=vision.get("layer_norm_eps", _SIGLIP_DEFAULTS["layer_norm_eps"]),
            num_channels=vision.get("num_channels", _SIGLIP_DEFAULTS["num_channels"]),
            mm_tokens_per_image=need(data, "", "mm_tokens_per_image"),
            text_hidden_size=need(text, "text_config.", "hidden_size"),
            image_mean=tuple(image_mean),
            image_std=tuple(image_std),
        )


def _section(data: Mapping, key: str) -> Mapping:
    section = data.get(key)
    if hasattr(section, "to_dict"):
        section = section.to_dict()
    if not isinstance(section, Mapping):
        raise ValueError(f"{key} is missing from the config (is this a Gemma 3 vision model?)")
    return section
