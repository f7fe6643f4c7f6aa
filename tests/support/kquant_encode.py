"""A small round-to-nearest encoder of float weights into GGUF's Q2_K, Q4_K, Q5_K, Q6_K and IQ4_NL
blocks (IQ4_NL: a scale per 32 from the largest magnitude, each value the nearest entry of
the non-linear table).

``gguf.quants`` can dequantise the K-quants but not quantise them, and the tests need K-quant
GGUF files of a known model. This is the plain scheme (no llama.cpp search for the best scale):
per sub-block a scale (and a min) from the range, stored as 6-bit / int8 multiples of an fp16
super-block scale, then the values rounded. Its output is valid by construction; the tests
check it against ``gguf.quants.dequantize`` (the truth), not against the engine's decoder.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [..., 2], the float32 value those bytes hold)."""
    h = x.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _sub_blocks(w: np.ndarray, levels: int, sc_max: int):
    """Blocks [n, nb, sub-blocks, values] -> (d bytes, dmin bytes, scales, mins, q values): per
    sub-block a scale and a min from its range, stored as integer multiples (0..``sc_max``) of
    the super-block's fp16 d and dmin, then the values rounded to 0..``levels``."""
    lo = np.minimum(w.min(-1), 0.0)
    scale, mn = (w.max(-1) - lo) / levels, -lo
    d_bytes, d = _f16(scale.max(-1) / sc_max)
    m_bytes, dmin = _f16(mn.max(-1) / sc_max)
    sc = np.clip(np.rint(_div(scale, d[..., None])), 0, sc_max).astype(np.uint8)
    mi = np.clip(np.rint(_div(mn, dmin[..., None])), 0, sc_max).astype(np.uint8)
    eff_d = d[..., None] * sc.astype(np.float32)
    eff_m = dmin[..., None] * mi.astype(np.float32)
    q = np.clip(np.rint(_div(w + eff_m[..., None], eff_d[..., None] + 0 * w)), 0, levels)
    return d_bytes, m_bytes, sc, mi, q.astype(np.uint8)


def _scales_mins(w: np.ndarray, levels: int):
    """Q4_K/Q5_K: blocks [n, nb, 8, 32] -> (d bytes, dmin bytes, 12 scale bytes, q values)."""
    d_bytes, m_bytes, sc, mi, q = _sub_blocks(w, levels, 63)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                             mi[..., :4] | ((mi[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mi[..., 4:] & 0x0F) << 4)], axis=-1)
    return d_bytes, m_bytes, packed, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, nb, 8, 32] values -> 128 bytes: sub-block 2c low nibbles, 2c+1 high, chunk c."""
    q = q & 0x0F
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(*q.shape[:2], 128)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    d, dmin, scales, q = _scales_mins(w.reshape(n, k // QK, 8, 32).astype(np.float32), 15)
    return np.concatenate([d, dmin, scales, _nibbles(q)], axis=-1).reshape(n, -1)


def encode_q5_k(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    d, dmin, scales, q = _scales_mins(w.reshape(n, k // QK, 8, 32).astype(np.float32), 31)
    bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]  # bit s: sub-block s
    qh = bits.sum(axis=-2, dtype=np.uint8)
    return np.concatenate([d, dmin, scales, qh, _nibbles(q)], axis=-1).reshape(n, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    b = w.reshape(n, k // QK, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_div(scale, d[..., None])), -128, 127).astype(np.int8)
    eff = d[..., None] * sc.astype(np.float32)
    q = (np.clip(np.rint(_div(b, eff[..., None] + 0 * b)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, k // QK, 2, 128)  # two halves of 128
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)
    hi = (q >> 4).reshape(n, k // QK, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qh = hi.sum(axis=-2, dtype=np.uint8)
    return np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64),
                           sc.view(np.uint8), d_bytes], axis=-1).reshape(n, -1)


def encode_q2_k(w: np.ndarray) -> np.ndarray:
    """Per 16 values a 4-bit scale and min (multiples of the fp16 d, dmin), values 0..3; block:
    16 bytes of scale | min << 4, 64 bytes of 2-bit values (element 128h + 32s + j in bits
    2s..2s+1 of byte 32h + j), d, dmin."""
    n, k = w.shape
    d_bytes, m_bytes, sc, mi, q = _sub_blocks(w.reshape(n, k // QK, 16, 16).astype(np.float32),
                                              3, 15)
    q = q.reshape(n, k // QK, 2, 4, 32)  # [half, shift, byte]
    qs = (q << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8)
    return np.concatenate([sc | (mi << 4), qs.reshape(n, -1, 64), d_bytes, m_bytes],
                          axis=-1).reshape(n, -1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.float32)


def encode_iq4_nl(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    b = w.reshape(n, k // 32, 32).astype(np.float32)
    d_bytes, d = _f16(np.abs(b).max(-1) / 127)
    idx = np.abs(b[..., None] - d[..., None, None] * IQ4_VALUES).argmin(-1).astype(np.uint8)
    return np.concatenate([d_bytes, idx[..., :16] | (idx[..., 16:] << 4)],
                          axis=-1).reshape(n, -1)


ENCODERS = {"Q2_K": encode_q2_k, "Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k,
            "IQ4_NL": encode_iq4_nl}
