"""preprocess gives HF's Gemma 3 image processor's pixel_values (its PIL backend, the one that
needs no torchvision) for images of several sizes and modes, transparency included, with the
default and with a custom mean and std."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from engine.vision.config import VisionConfig
from engine.vision.images import preprocess

CFG = VisionConfig(image_size=64, patch_size=8, hidden_size=32, intermediate_size=40,
                   num_layers=2, num_heads=2, mm_tokens_per_image=16, text_hidden_size=48)


def _noise(mode: str, size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    w, h = size
    shape = (h, w) if bands == 1 else (h, w, bands)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


def _palette_with_transparency() -> Image.Image:
    image = _noise("RGB", (40, 40), 7).quantize(colors=16)
    image.info["transparency"] = 3  # palette entry 3 is see-through
    return image


IMAGES = {
    "rgb-100x80": lambda: _noise("RGB", (100, 80), 1),
    "rgba-50x50": lambda: _noise("RGBA", (50, 50), 2),
    "l-64x64-no-resize": lambda: _noise("L", (64, 64), 3),
    "rgb-200x30-non-square": lambda: _noise("RGB", (200, 30), 4),
    "la-33x90": lambda: _noise("LA", (33, 90), 5),
    "p-transparency": _palette_with_transparency,
    "rgb-640x480-downscale": lambda: _noise("RGB", (640, 480), 6),
}


def _hf(images, **kwargs) -> torch.Tensor:
    processor = Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, **kwargs)
    return processor(images=images, return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize("name", IMAGES)
def test_one_image_equals_hf(name):
    image = IMAGES[name]()
    want = _hf([image])
    got = preprocess([image], CFG)
    assert got.dtype == torch.float32 and got.shape == (1, 3, 64, 64)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_batch_with_custom_mean_and_std_equals_hf():
    images = [make() for make in IMAGES.values()]
    mean, std = (0.48, 0.45, 0.40), (0.26, 0.26, 0.27)
    cfg = VisionConfig(**{**CFG.__dict__, "image_mean": mean, "image_std": std})
    want = _hf(images, image_mean=list(mean), image_std=list(std))
    got = preprocess(images, cfg)
    assert got.shape == (len(images), 3, 64, 64)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert not torch.allclose(got, preprocess(images, CFG), atol=1e-3)


def test_transparency_is_composited_on_white():
    clear = Image.new("RGBA", (64, 64), (255, 0, 0, 0))  # red, but fully transparent
    assert torch.all(preprocess([clear], CFG) == 1.0)  # white: (1 - 0.5) / 0.5


def test_no_images_is_an_error():
    with pytest.raises(ValueError, match="at least one image"):
        preprocess([], CFG)
