"""Rotary position embeddings (HF's rotate-half layout), with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch

from engine.models.arch import RopeSpec


def inv_frequencies(spec: RopeSpec, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64)
                                     .to(torch.float32) / rotary_dim))
    if spec.rope_type == "linear":
        inv_freq = inv_freq / spec.factor
    elif spec.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
        # between interpolated smoothly.
        old_len = spec.original_max_position_embeddings
        low_wavelen = old_len / spec.low_freq_factor
        high_wavelen = old_len / spec.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
        smooth = (old_len / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables; ``cos_sin(positions)`` is taken once per step for all layers.

    The rotate-half layout repeats each frequency in both halves of a head, so the tables hold
    the ``head_dim / 2`` distinct columns (``cos_half``, ``sin_half``, float32
    ``[max_positions, head_dim / 2]``) and :meth:`rows` widens the rows a step asks for: half
    the memory of full-width tables (a 32k-position table of head_dim 256, as Gemma 3 has two
    of, takes 32 MiB instead of 64), the same values."""

    def __init__(self, spec: RopeSpec, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = inv_frequencies(spec, head_dim)
        t = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_half", freqs.cos(), persistent=False)
        self.register_buffer("sin_half", freqs.sin(), persistent=False)

    @property
    def max_positions(self) -> int:
        return self.cos_half.shape[0]

    def rows(self, positions: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-width float32 cos, sin of ``positions`` (``[..., head_dim]``; an int gives
        ``[head_dim]``), unchecked."""
        c, s = self.cos_half[positions], self.sin_half[positions]
        return torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` in ``dtype`` for the given positions.

        ``max_position`` (the largest position, known on the host) is checked against the
        table; without it the check reads ``positions`` only when they are on the CPU, so a
        GPU step never waits on a device->host read here."""
        if max_position is None and positions.numel() and positions.device.type == "cpu":
            max_position = int(positions.max())
        if max_position is not None and max_position >= self.max_positions:
            raise ValueError(f"position {max_position} is beyond the RoPE table "
                             f"({self.max_positions} positions)")
        cos, sin = self.rows(positions)
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, D]``, cos/sin ``[T, 1, D]``; rotate-half convention as in HF Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
