"""The SigLIP vision transformer of Gemma 3: pixels in, one hidden vector per patch out.

``SiglipTower(config)(pixel_values [B, 3, S, S]) -> [B, patches, hidden]``. The image is cut
into non-overlapping ``patch_size`` squares (a convolution whose stride is its kernel), each
patch gets its learned position vector, then ``num_layers`` pre-LayerNorm encoder layers run
(bidirectional multi-head attention, then a GELU-tanh MLP, each added back to its input) and a
final LayerNorm. Patches are numbered row by row, as the projector's pooling expects. Weights
come from ``weights.py``; a fresh tower holds uninitialised parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.vision.config import VisionConfig


class SelfAttention(nn.Module):
    """Multi-head attention where every patch sees every patch (no mask, no causality)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        width = config.hidden_size
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        # The default scale is 1 / sqrt(head_dim), SigLIP's.
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class FeedForward(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SelfAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipTower(nn.Module):
    """Patch embedding + position vectors, the encoder layers, the post LayerNorm."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         kernel_size=config.patch_size, stride=config.patch_size)
        # One learned vector per patch position, row-major.
        self.position_embedding = nn.Parameter(torch.empty(config.num_patches, config.hidden_size))
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[B, 3, image_size, image_size]`` -> ``[B, num_patches, hidden_size]``."""
        grid = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = grid.flatten(2).transpose(1, 2) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)
