"""The image side of a checkpoint directory: its ``VisionConfig`` and a loaded ``ImageEmbedder``.

A directory serves images when its config has a ``vision_config`` (HF's ``Gemma3Config``) and
its safetensors hold the tower and projector. The pixel mean and std come from
``preprocessor_config.json`` when the directory has one (Gemma 3's defaults otherwise).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from engine.vision.config import DEFAULT_IMAGE_MEAN, DEFAULT_IMAGE_STD, VisionConfig
from engine.vision.embedder import ImageEmbedder
from engine.vision.mmproj import load_mmproj_encoder
from engine.vision.weights import load_image_encoder, read_vision_tensors

logger = logging.getLogger("kvserve.engine")


def vision_config_of(hf_config: Any, model_dir: Path | None) -> VisionConfig | None:
    """The checkpoint's ``VisionConfig``, or None for a text-only config."""
    if getattr(hf_config, "vision_config", None) is None:
        return None
    mean, std = DEFAULT_IMAGE_MEAN, DEFAULT_IMAGE_STD
    pre = Path(model_dir) / "preprocessor_config.json" if model_dir is not None else None
    if pre is not None and pre.is_file():
        data = json.loads(pre.read_text())
        mean, std = data.get("image_mean", mean), data.get("image_std", std)
    return VisionConfig.from_hf(hf_config, image_mean=mean, image_std=std)


def load_embedder(hf_config: Any, model_dir: Path | None, device: torch.device,
                  mmproj: str | Path | None = None) -> ImageEmbedder | None:
    """An ``ImageEmbedder`` on ``device`` (float32) for a vision checkpoint in ``model_dir``,
    or from llama.cpp's ``mmproj`` GGUF when given (a Gemma 3 text model's: its width must be
    the text model's), or None when the config is text-only. ``ValueError`` when the config
    names a vision tower whose weights are missing or misshapen, or for an unusable mmproj."""
    if mmproj is not None:
        start = time.perf_counter()
        encoder = load_mmproj_encoder(mmproj)
        width = getattr(getattr(hf_config, "text_config", hf_config), "hidden_size", None)
        if encoder.config.text_hidden_size != width:
            raise ValueError(f"the mmproj {mmproj} projects images to width "
                             f"{encoder.config.text_hidden_size}; the model's is {width}")
        _log_loaded(encoder.config, start, f"from {Path(mmproj).name}")
        return ImageEmbedder(encoder.to(device))
    config = vision_config_of(hf_config, model_dir)
    if config is None or model_dir is None:
        return None
    start = time.perf_counter()
    tensors = read_vision_tensors(model_dir)
    if not tensors:
        logger.warning("the config names a vision tower but %s holds none of its weights: "
                       "serving text only", model_dir)
        return None
    encoder = load_image_encoder(config, tensors).to(device)
    _log_loaded(config, start, "from the checkpoint")
    return ImageEmbedder(encoder)


def _log_loaded(config: VisionConfig, start: float, source: str) -> None:
    logger.info("image encoder (%s): %d layers, %d soft tokens per %dx%d image, loaded in "
                "%.1f s", source, config.num_layers, config.tokens_per_image, config.image_size,
                config.image_size, time.perf_counter() - start)
