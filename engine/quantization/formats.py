"""Packed weight formats that GGUF's block types map onto exactly (``engine.quantization.gguf_blocks``
decodes the blocks; ``engine.quantization.rtn`` quantises float weights onto the same forms).

The formats hold a weight ``W [N, K]`` (``K`` a multiple of :data:`GROUP`) in groups of 32
consecutive input elements of one output row, with float32 scales (GGUF stores fp16; float32
saves a conversion per group in the kernel): :class:`PackedQ4` (4-bit, GGUF's Q4_0/Q4_1
nibble order), :class:`PackedQ8` (int8, a scale per 16 or 32 and an optional min),
:class:`PackedQ5` (5-bit, Q5_0/Q5_1's nibbles and fifth bits); each class states its layout.

``dequantize()`` of each equals ``gguf.quants.dequantize`` of the source blocks (Q4_0, Q8_0
and Q6_K bit for bit; with a min, up to one rounding of ``d * q + m`` where a fused
multiply-add is used). Rows can be selected (``take_rows``) and concatenated (``cat``) without
touching the values: that is how llama.cpp's Q/K row permutation is undone and how fused
projections are built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
SCALE_GROUPS = (16, 32)  # the 8-bit form's scale groups


@dataclass
class PackedQ4:
    """4-bit groups of 32: ``w = d * q + m`` with ``q`` in 0..15.

    ``qs`` uint8 ``[N, K/2]``, ``d`` and ``m`` float32 ``[N, K/32]``. Byte ``j`` of group ``g``
    holds ``q[32g + j]`` in its low nibble and ``q[32g + j + 16]`` in its high nibble: GGUF's
    Q4_0/Q4_1 order. Q4_1 is ``(d, m)`` as stored; Q4_0 (``w = d * (q - 8)``) is ``m = -8 d``,
    exact in float32; Q4_K is ``d = d_super * sc``, ``m = -dmin * min`` per sub-block of 32
    (products of an fp16 and a 6-bit integer: exact in float32)."""

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
    """8-bit values, a scale per ``scale_group`` (16 or 32) of them and an optional min per
    scale group: ``w = d * q (+ m)``. Construction checks the shapes (ValueError).

    ``qs`` int8 ``[N, K]``, ``d`` float32 ``[N, K/S]``, optional ``m`` shaped like ``d``;
    ``w = d[k // S] * q (+ m[k // S])``. Q8_0 is ``S = 32`` without ``m``; Q5_K is ``S = 32``
    with ``m`` (``q`` in 0..31); Q6_K is ``S = 16`` without ``m`` (``q`` in -32..31, its
    16-element sub-blocks keep their own scale ``d * sc``); Q2_K is ``S = 16`` with ``m``
    (``q`` in 0..3, ``d * sc`` and ``-dmin * min`` per 16)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.qs.shape
        if (k % GROUP or self.d.dim() != 2 or self.d.shape[0] != n
                or self.scale_group not in SCALE_GROUPS or self.d.shape[1] * self.scale_group != k):
            raise ValueError(f"an 8-bit weight [{n}, {k}] needs K a multiple of {GROUP} and "
                             f"one scale per 16 or 32 values; got scales {tuple(self.d.shape)}")
        if self.m is not None and self.m.shape != self.d.shape:
            raise ValueError("an 8-bit weight's mins go one per scale group, like its scales")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qs.shape)

    @property
    def scale_group(self) -> int:
        """Values per scale: 32, or 16 (Q6_K)."""
        return self.qs.shape[1] // max(self.d.shape[-1], 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m)
                   if t is not None)

    def take_rows(self, rows: torch.Tensor) -> PackedQ8:
        return PackedQ8(self.qs[rows].contiguous(), self.d[rows].contiguous(),
                        None if self.m is None else self.m[rows].contiguous())

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]`` (reference implementation, in PyTorch)."""
        n, k = self.shape
        s = self.scale_group
        w = self.qs.view(n, k // s, s).float() * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(n, k)


@dataclass
class PackedQ5:
    """5-bit groups of 32: ``w = d * q + m`` with ``q`` in 0..31.

    ``qs`` uint8 ``[N, K/32 * 20]``, ``d`` and ``m`` float32 ``[N, K/32]``. Each group of 32 is
    20 bytes: 16 bytes of low nibbles in Q4_0's order, then the 32 fifth bits as a little-endian
    uint32 (bit ``j``: element ``j``), GGUF's Q5_0/Q5_1 blocks without their fp16 scales. Q5_0
    (``w = d * (q - 16)``) is ``m = -16 d``, exact in float32; Q5_1 is ``(d, m)`` as stored.
    7 bits per weight (GGUF: 5.5 and 6), where widening to :class:`PackedQ8` would take 9 and
    10."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    BYTES = 20  # per group of 32: 16 bytes of nibbles, 4 of fifth bits

    def __post_init__(self) -> None:
        n, width = self.qs.shape
        if (self.qs.dtype != torch.uint8 or width % self.BYTES or self.d.shape != (n, width // 20)
                or self.m.shape != self.d.shape):
            raise ValueError(f"a 5-bit weight needs uint8 groups of {self.BYTES} bytes and one "
                             f"scale and min per group; got {tuple(self.qs.shape)} bytes and "
                             f"scales {tuple(self.d.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] // self.BYTES * GROUP

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def take_rows(self, rows: torch.Tensor) -> PackedQ5:
        return PackedQ5(self.qs[rows].contiguous(), self.d[rows].contiguous(),
                        self.m[rows].contiguous())

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[N, K]`` (reference implementation, in PyTorch)."""
        n, k = self.shape
        g = self.qs.view(n, k // GROUP, self.BYTES)
        low = torch.cat([g[..., :16] & 0x0F, g[..., :16] >> 4], dim=-1)
        bits = torch.arange(8, dtype=torch.uint8)
        high = ((g[..., 16:, None] >> bits) & 1).reshape(n, k // GROUP, GROUP)
        q = (low | (high << 4)).float()
        return (q * self.d[..., None] + self.m[..., None]).reshape(n, k)


Packed = PackedQ4 | PackedQ8 | PackedQ5


def cat(parts: list[Packed]) -> Packed:
    """Rows of ``parts`` one after the other (same format, ``K``, scale group and min presence;
    else ValueError)."""
    kinds = {_layout(p) for p in parts}
    if len(kinds) != 1:
        raise ValueError("only packed weights of one format and width can be concatenated")
    if isinstance(parts[0], (PackedQ4, PackedQ5)):
        return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts])
                                for f in ("qs", "d", "m")))
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return PackedQ8(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)


def same_layout(parts: list[Packed]) -> bool:
    """True when ``parts`` can be concatenated by :func:`cat`."""
    return len({_layout(p) for p in parts}) == 1


def _layout(p: Packed) -> tuple:
    if isinstance(p, PackedQ4):
        return ("q4", p.shape[1])
    if isinstance(p, PackedQ5):
        return ("q5", p.shape[1])
    return ("q8", p.shape[1], p.scale_group, p.m is not None)
