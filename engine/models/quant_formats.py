"""Packed weight formats that GGUF's Q4_0, Q4_1 and Q8_0 blocks map onto exactly.

Both formats hold a weight ``W [N, K]`` (``K`` a multiple of :data:`GROUP`) in groups of 32
consecutive input elements of one output row, with float32 scales (GGUF stores fp16; float32
costs 2 bytes more per group and saves a conversion per group in the kernel):

* :class:`PackedQ4`: ``qs`` uint8 ``[N, K/2]``, ``d`` and ``m`` float32 ``[N, K/32]``;
  ``w = d * q + m`` with ``q`` in 0..15. Byte ``j`` of group ``g`` holds ``q[32g + j]`` in its
  low nibble and ``q[32g + j + 16]`` in its high nibble: GGUF's own order, copied as is.
  Q4_1 is ``(d, m)`` as stored; Q4_0 (``w = d * (q - 8)``) is ``m = -8 d``, exact in float32.
* :class:`PackedQ8`: ``qs`` int8 ``[N, K]``, ``d`` float32 ``[N, K/32]``; ``w = d * q``.

``dequantize()`` of either equals ``gguf.quants.dequantize`` of the source blocks (Q4_0 and
Q8_0 bit for bit; Q4_1 up to one rounding of ``d * q + m`` where a fused multiply-add is used).
Rows can be selected (``take_rows``) and concatenated (``cat``) without touching the values:
that is how llama.cpp's Q/K row permutation is undone and how fused projections are built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
# GGUF block type ids (gguf.GGMLQuantizationType): bytes per block of 32 elements.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
SUPPORTED = tuple(BLOCK_BYTES)


@dataclass
class PackedQ4:
    """4-bit groups of 32: ``w = d * q + m`` (see the module docstring for the layout)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def take_rows(self, rows: torch.Tensor) -> PackedQ4:
        return PackedQ4(self.qs[rows].contiguous(), self.d[rows].contiguous(),
                        self.m[rows].contiguous())

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]`` (reference implementation, in PyTorch)."""
        n, k = self.shape
        q = self.qs.view(n, k // GROUP, 16)
        q = torch.cat([q & 0x0F, q >> 4], dim=-1).float()
        return (q * self.d[..., None] + self.m[..., None]).reshape(n, k)


@dataclass
class PackedQ8:
    """8-bit groups of 32: ``w = d * q``."""

    qs: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qs.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d))

    def take_rows(self, rows: torch.Tensor) -> PackedQ8:
        return PackedQ8(self.qs[rows].contiguous(), self.d[rows].contiguous())

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return (self.qs.view(n, k // GROUP, GROUP).float() * self.d[..., None]).reshape(n, k)


Packed = PackedQ4 | PackedQ8


def cat(parts: list[Packed]) -> Packed:
    """Rows of ``parts`` one after the other (same format and ``K``; else ValueError)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError("only packed weights of one format and width can be concatenated")
    if isinstance(parts[0], PackedQ4):
        return PackedQ4(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "m")))
    return PackedQ8(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d")))


def from_gguf_blocks(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> Packed:
    """Pack GGUF blocks ``raw`` (the bytes of a ``[N, K]`` tensor, row-major: ``N`` rows of
    ``K/32`` blocks) of type ``qtype`` (one of :data:`SUPPORTED`). Copies the data."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF block type {qtype} has no packed format here")
    n, k = shape
    if k % GROUP:
        raise ValueError(f"a quantised tensor's rows must be a multiple of {GROUP}; got {k}")
    g = k // GROUP
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, g, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32).reshape(n, g)
    if qtype == Q8_0:
        qs = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return PackedQ8(torch.from_numpy(qs), torch.from_numpy(d))
    if qtype == Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32).reshape(n, g)
        qs = blocks[..., 4:].reshape(n, k // 2).copy()
    else:
        m = -8.0 * d
        qs = blocks[..., 2:].reshape(n, k // 2).copy()
    return PackedQ4(torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m))
