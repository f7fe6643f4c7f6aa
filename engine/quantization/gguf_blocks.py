"""GGUF's quantised block types decoded onto the packed forms of ``engine.quantization.formats``.

Every mapping is exact: the packed form dequantises to ``gguf.quants.dequantize`` of the same
blocks (see formats' docstring for the rounding of a min). Q4_0, Q4_1, Q4_K go to ``PackedQ4``;
Q8_0, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS to ``PackedQ8`` (widened to 8 bits, products such
as ``d * (sc - 32) * q`` needing at most 24 significant bits, so every mapped value is exact;
Q2_K's ``d * sc * q - dmin * mn`` rounds once, as gguf's does); Q5_0, Q5_1 to ``PackedQ5``.
The type-by-type table is on :func:`from_gguf_blocks`.

The bit layouts follow ggml's reference dequantisers (``dequantize_row_q4_K`` etc., mirrored
by ``gguf.quants``). Contract of :func:`from_gguf_blocks`: ``raw`` holds the bytes of a
``[N, K]`` tensor, row-major (``N`` rows of ``K / block elements`` blocks); returns a new packed
weight (copies the data); raises ValueError for another type or a ``K`` the type cannot hold."""

from __future__ import annotations

import numpy as np
import torch

from engine.quantization.formats import GROUP, Packed, PackedQ4, PackedQ5, PackedQ8

# GGUF block type ids (gguf.GGMLQuantizationType) -> (elements, bytes) per block.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176),
          Q6_K: (256, 210), IQ4_NL: (32, 18), IQ4_XS: (256, 136)}
SUPPORTED = tuple(BLOCKS)
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q2_K: "Q2_K",
         Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_NL: "IQ4_NL",
         IQ4_XS: "IQ4_XS"}
# IQ4_NL/IQ4_XS: the int8 value of each 4-bit index (ggml's kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int8)


def from_gguf_blocks(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> Packed:
    """Pack GGUF blocks of type ``qtype`` (one of :data:`SUPPORTED`); see the module contract.

    ========  ============================  ====================================================
    type      GGUF block                    packed form
    ========  ============================  ====================================================
    Q4_0      32: fp16 d, 16 B nibbles      PackedQ4, ``m = -8 d``
    Q4_1      32: fp16 d, m, 16 B nibbles   PackedQ4 as stored
    Q8_0      32: fp16 d, 32 int8           PackedQ8, scale per 32
    Q4_K      256: fp16 d, dmin, 12 B of    PackedQ4 per sub-block of 32: ``d * sc``,
              6-bit sc/mn, 128 B nibbles    ``-dmin * mn`` (nibbles re-laid out: Q4_0's order)
    Q5_K      Q4_K + 32 B of 5th bits       PackedQ8 (q in 0..31), scale and min per 32
    Q6_K      256: 128 B low 4 bits, 64 B   PackedQ8 (q - 32 in -32..31), ``d * sc`` per 16
              high 2 bits, 16 int8 sc, d
    Q5_0      32: fp16 d, 4 B fifth bits,   PackedQ5 (nibbles, fifth bits as stored),
              16 B nibbles                  ``m = -16 d``
    Q5_1      32: fp16 d, m, then as Q5_0   PackedQ5 as stored
    Q2_K      256: 16 B 4-bit sc/mn, 64 B   PackedQ8 (q in 0..3), scale ``d * sc`` and min
              2-bit q, fp16 d, dmin         ``-dmin * mn`` per 16
    Q3_K      256: 32 B high-bit mask, 64   PackedQ8 (q in -4..3), ``d * (sc - 32)`` per 16
              B 2-bit q, 12 B 6-bit sc, d
    IQ4_NL    32: fp16 d, 16 B indices      PackedQ8 (the non-linear table's int8 values), d
    IQ4_XS    256: d, 6-bit sc per 32,      PackedQ8 (table values), ``d * (sc - 32)`` per 32
              128 B indices
    ========  ============================  ====================================================

    Q2_K, Q3_K, IQ4_NL and IQ4_XS widen to 8 bits (2-4x their GGUF bytes, a third of float32's
    or less)."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF block type {qtype} has no packed format here")
    n, k = shape
    per_block, nbytes = BLOCKS[qtype]
    if k % per_block:
        raise ValueError(f"a {NAMES[qtype]} tensor's rows must be a multiple of {per_block}; "
                         f"got {k}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per_block, nbytes)
    decode = {Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0, Q2_K: _q2_k,
              Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, IQ4_NL: _iq4_nl,
              IQ4_XS: _iq4_xs}
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


def _q5_groups(blocks: np.ndarray, n: int, k: int, head: int) -> np.ndarray:
    """Q5_0/Q5_1 blocks (``head`` bytes of fp16 fields, 4 of fifth bits, 16 of nibbles) ->
    PackedQ5's 20 bytes per group: the nibbles, then the fifth bits."""
    qh, qs = blocks[..., head:head + 4], blocks[..., head + 4:head + 20]
    return np.concatenate([qs, qh], axis=-1).reshape(n, k // GROUP * PackedQ5.BYTES)


def _q5_0(blocks: np.ndarray, n: int, k: int) -> Packed:
    d = _f16(blocks[..., 0:2])
    return PackedQ5(_t(_q5_groups(blocks, n, k, 2)), _t(d), _t(-16.0 * d))


def _q5_1(blocks: np.ndarray, n: int, k: int) -> Packed:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    return PackedQ5(_t(_q5_groups(blocks, n, k, 4)), _t(d), _t(m))


def _iq4_values(qs: np.ndarray) -> np.ndarray:
    """16 bytes of indices per group of 32 (low nibbles: elements 0-15, high: 16-31) -> int8
    table values [..., groups, 32]."""
    idx = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return IQ4_VALUES[idx]


def _iq4_nl(blocks: np.ndarray, n: int, k: int) -> Packed:
    q = _iq4_values(blocks[..., 2:18])
    return PackedQ8(_t(q.reshape(n, k)), _t(_f16(blocks[..., 0:2])))


def _iq4_xs(blocks: np.ndarray, n: int, k: int) -> Packed:
    lead = blocks.shape[:-1]
    d = _f16(blocks[..., 0:2])
    high = blocks[..., 2:4].copy().view(np.uint16)  # [..., 1]: 2 bits per sub-block
    high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = blocks[..., 4:8]
    low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(*lead, 8)
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32.0
    q = _iq4_values(blocks[..., 8:136].reshape(*lead, 8, 16))
    return PackedQ8(_t(q.reshape(n, k)), _t((d[..., None] * sc).reshape(n, -1)))


def _two_bit_values(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit values per super-block -> uint8 [..., 256]: element
    ``128h + 32s + j`` is bits ``2s..2s+1`` of byte ``32h + j``."""
    q = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1))
    return (q & 3).reshape(*qs.shape[:-1], 256)


def _q2_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    s, qs = blocks[..., 0:16], blocks[..., 16:80]
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])
    # Sub-block i (16 elements): scale d * (s[i] & 15), min -dmin * (s[i] >> 4).
    sc = d[..., None] * (s & 0x0F).astype(np.float32)
    mn = -(dmin[..., None] * (s >> 4).astype(np.float32))
    q = _two_bit_values(qs).astype(np.int8)
    return PackedQ8(_t(q.reshape(n, k)), _t(sc.reshape(n, -1)), _t(mn.reshape(n, -1)))


def _q3_k(blocks: np.ndarray, n: int, k: int) -> Packed:
    lead = blocks.shape[:-1]
    hmask, qs, s = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = _f16(blocks[..., 108:110])
    # 16 6-bit scales: low nibbles of bytes 0-7 (sub-blocks 0-7) then their high nibbles
    # (8-15); sub-block i's top 2 bits are bits 2 (i // 4) .. +1 of byte 8 + i % 4.
    low = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    top = (s[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # [..., byte, shift]
    top = top.swapaxes(-1, -2).reshape(*lead, 16)
    sc = (low | (top << 4)).astype(np.float32) - 32.0
    # Elements 128h + 32s + j: bits 2s..2s+1 of qs byte 32h + j; element i's "no -4" bit is bit
    # i // 32 of hmask byte i % 32.
    hb = (hmask.reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = _two_bit_values(qs).astype(np.int8) - ((1 - hb.reshape(*lead, 256)) * 4).astype(np.int8)
    return PackedQ8(_t(q.reshape(n, k)), _t((d[..., None] * sc).reshape(n, -1)))


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
