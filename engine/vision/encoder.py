"""``ImageEncoder``: preprocessed pixels to the soft-token embeddings of Gemma 3's prompt.

``encode(pixel_values [B, 3, S, S]) -> [B, tokens_per_image, text_hidden_size]``, the SigLIP
tower then the projector, under ``torch.inference_mode()``. The encoder is built in float32 on
the CPU with uninitialised weights; ``weights.load_image_encoder`` fills them from a checkpoint.
Each image's embeddings depend on that image alone (no attention across the batch).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.vision.config import VisionConfig
from engine.vision.projector import Projector
from engine.vision.siglip import SiglipTower


class ImageEncoder(nn.Module):
    """The tower and the projector of one Gemma 3 checkpoint."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.tower = SiglipTower(config)
        self.projector = Projector(config)
        self.eval()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixel_values))

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Soft-token embeddings for a batch of preprocessed images (``images.preprocess``).

        Raises ``ValueError`` when ``pixel_values`` is not ``[B, 3, image_size, image_size]``
        with B >= 1. The result is in the encoder's dtype (float32 unless moved)."""
        cfg = self.config
        want = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want \
                or pixel_values.shape[0] == 0:
            raise ValueError(f"pixel_values must be [B, {want[0]}, {want[1]}, {want[2]}] with "
                             f"B >= 1, got {list(pixel_values.shape)}")
        weight = self.projector.projection
        with torch.inference_mode():
            return self(pixel_values.to(device=weight.device, dtype=weight.dtype))
