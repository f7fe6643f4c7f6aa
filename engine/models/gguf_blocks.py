"""GGUF's quantised block types decoded onto the packed forms of ``engine.models.quant_formats``.

Every mapping is exact (the packed form dequantises to ``gguf.quants.dequantize`` of the same
blocks, see quant_formats' docstring for the rounding of a min):

========  ============================  =========================================================
type      GGUF block                    packed form
========  ============================  =========================================================
Q4_0      32: fp16 d, 16 B nibbles      PackedQ4, ``m = -8 d``
Q4_1      32: fp16 d, m, 16 B nibbles   PackedQ4 as stored
Q8_0      32: fp16 d, 32 int8           PackedQ8, scale per 32
Q4_K      256: fp16 d, dmin, 12 B of    PackedQ4 per sub-block of 32: ``d * sc``, ``-dmin * mn``
          6-bit sc/mn, 128 B nibbles    (nibbles re-laid out into Q4_0's order)
Q5_K      Q4_K + 32 B of 5th bits       PackedQ8 (q in 0..31), scale and min per 32
Q6_K      256: 128 B low 4 bits, 64 B   PackedQ8 (q - 32 in -32..31), scale ``d * sc`` per 16
          high 2 bits, 16 int8 sc, d
========  ============================  =========================================================

The bit layouts follow ggml's reference dequantisers (``dequantize_row_q4_K`` etc., mirrored
by ``gguf.quants``). Contract of :func:`from_gguf_blocks`: ``raw`` holds the bytes of a
``[N, K]`` tensor, row-major (``N`` rows of ``K / block elements`` blocks); returns a new packed
weight (copies the data); raises ValueError for another type or a ``K`` the type cannot hold.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.quant_formats import GROUP, Packed, PackedQ4, PackedQ8

# GGUF block type ids (gguf.GGMLQuantizationType) -> (elements, bytes) per block.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
SUPPORTED = tuple(BLOCKS)
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}


def from_gguf_blocks(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> Packed:
    """Pack GGUF blocks of type ``qtype`` (one of :data:`SUPPORTED`); see the module contract."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF block type {qtype} has no packed format here")
    n, k = shape
    per_block, nbytes = BLOCKS[qtype]
    if k % per_block:
        raise ValueError(f"a {NAMES[qtype]} tensor's rows must be a multiple of {per_block}; "
                         f"got {k}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per_block, nbytes)
    decode = {Q4_0: _q4_0, Q4_1: _q4_1, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}
    return decode[qtype](blocks, n, k)


def _f16(b: np.ndarray) -> np.ndarray:
    """fp16 fields (the last axis: 2 bytes) as float32, one value per block."""
    return b.copy().view(np.float16).astype(np.float32)[..., 0]


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _q4_0(blocks: np.ndarray, n: int, k: int) -> Packed:
    d = _f16(blocks[..., 0:2])
    return PackedQ4(_t(blocks[..., 2:].reshape(n, k // 2)), _t(d), _t(-8.0 * d))


def _q4_1(blocks: np.ndarray, n: int, k: int) -> Packed:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    return PackedQ4(_t(blocks[..., 4:].reshape(n, k // 2)), _t(d), _t(m))


def _q8_0(blocks: np.ndarray, n: int, k: int) -> Packed:
    qs = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return PackedQ8(_t(qs), _t(_f16(blocks[..., 0:2])))


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per super-block, (d * sc, -dmin * mn) for its 8 sub-blocks, float32."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16]
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    # (mins); sub-blocks 4-7 from bytes 8-11's nibbles plus the top 2 bits of bytes 0-7.
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * mn.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes per super-block -> uint8 values [..., 8 sub-blocks, 32]: bytes
    32c..32c+31 hold sub-block 2c in their low nibbles and 2c+1 in their high nibbles."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _to_q4_order(q: np.ndarray, n: int, k: int) -> np.ndarray:
    """Values [n, groups, 32] in 0..15 -> Q4_0's bytes: byte j = q[j] | q[j + 16] << 4."""
    q = q.reshape(n, k // GROUP, 32)
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8).reshape(n, k // 2)


def _q4_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    d, m = _k_scales(blocks)
    q = _k_low_nibbles(blocks[..., 16:144])
    return PackedQ4(_t(_to_q4_order(q, n, k)), _t(d.reshape(n, -1)), _t(m.reshape(n, -1)))


def _q5_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    d, m = _k_scales(blocks)
    qh = blocks[..., 16:48]  # bit s of byte j: the 5th bit of element j of sub-block s
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = _k_low_nibbles(blocks[..., 48:176]) | (high << 4)
    return PackedQ8(_t(q.astype(np.int8).reshape(n, k)), _t(d.reshape(n, -1)),
                    _t(m.reshape(n, -1)))


def _q6_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    lead = blocks.shape[:-1]
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    # Each half of 128 elements: 64 bytes of ql (low nibbles: elements 0-63, high: 64-127)
    # and 32 bytes of qh (bits 2i..2i+1 of byte j: element 32i + j).
    low = (ql.reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q = low.reshape(*lead, 256) | (high.reshape(*lead, 256) << 4)
    q = q.astype(np.int8) - np.int8(32)
    return PackedQ8(_t(q.reshape(n, k)), _t((d[..., None] * sc).reshape(n, -1)))
