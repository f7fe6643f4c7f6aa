"""Gemma 3's multimodal projector: the tower's patch vectors to soft tokens of the text width.

``Projector(config)(patches [B, num_patches, hidden]) -> [B, mm_tokens_per_image,
text_hidden_size]``: the row-major patch grid is average-pooled in non-overlapping squares of
``pool_kernel`` patches to a ``tokens_per_side``-square grid (row-major again), each pooled
vector is RMS-normalised in float32 with Gemma's ``(1 + weight)`` gain, then multiplied by the
``[hidden, text_hidden]`` projection matrix. The result has the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.vision.config import VisionConfig


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, computed in float32 and cast back to ``x``'s dtype.

    The stored ``weight`` is the offset from one (a zero weight is the identity gain), as in
    Gemma's checkpoints."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        scale = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x32 * scale * (1.0 + self.weight.float())).to(x.dtype)


class Projector(nn.Module):
    """Pool to ``mm_tokens_per_image`` tokens, RMS-normalise, project to the text width."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.norm = GemmaRMSNorm(config.hidden_size, config.layer_norm_eps)
        # Stored as HF stores it, [in, out]: the tokens are multiplied by it on the right.
        self.projection = nn.Parameter(torch.empty(config.hidden_size, config.text_hidden_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        batch, num_patches, width = patches.shape
        if num_patches != cfg.num_patches:
            raise ValueError(f"expected {cfg.num_patches} patches per image, got {num_patches}")
        side = cfg.patches_per_side
        grid = patches.transpose(1, 2).reshape(batch, width, side, side)
        pooled = F.avg_pool2d(grid, kernel_size=cfg.pool_kernel, stride=cfg.pool_kernel)
        tokens = pooled.flatten(2).transpose(1, 2)
        return torch.matmul(self.norm(tokens), self.projection).to(patches.dtype)
