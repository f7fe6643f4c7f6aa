"""Triton jit helpers for the int4 KV rows (kind 3 of kvserve_kernels/kv_quant_layout.py): packing
already-rotated rows as ``store_kv`` writes them, and unpacking elements as the attention tiles
read them. The PyTorch truth is ``_quantize_int4`` / ``dequantize_int4_plain`` in
engine/kv_format/formats.py; ``pack_int4_rows`` reproduces the former bit for bit:

* ``m``: the group's element of largest magnitude, the FIRST one in element order on a tie
  (``torch.argmax``'s rule), its sign included (read from the sign bit, so a group of zeros
  whose first element is -0.0 gives the same scale bits as PyTorch);
* ``scale = fp16(m * -0.125)`` (the same real number as ``m / -8``, so the same rounding);
* ``inv = 0`` when the scale is 0, else ``1 / scale`` rounded to nearest (``div_rn``: a plain
  ``/`` is an approximate division on NVIDIA GPUs);
* ``code = clamp(floor((y * inv + 8) + 0.5), 0, 15)``, each operation rounded on its own: the
  launch must pass ``enable_fp_fusion=False`` or a GPU fuses ``y * inv + 8`` into one FMA and
  rounds differently near half-way points.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pack_int4_rows(x_ptr, stride_h, cache_ptr, rows, heads, head_dim,
                   BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   GROUP: tl.constexpr):
    """Quantise rows ``h < heads`` of ``x`` (element ``[h, e]`` at ``x_ptr + h * stride_h +
    e``, already rotated) and write them as int4 rows at byte offsets ``rows`` ``[BLOCK_H]`` of
    ``cache_ptr`` (a uint8 pool). ``BLOCK_G`` >= groups per row and ``BLOCK_HALF`` >=
    ``GROUP // 2`` are powers of two. A tile ``[head, group, i]`` holds element ``i`` (the low
    nibbles) and element ``i + GROUP/2`` (the high ones) of each group side by side."""
    HALF: tl.constexpr = GROUP // 2
    h = tl.arange(0, BLOCK_H)[:, None, None]
    j = tl.arange(0, BLOCK_G)[None, :, None]
    i = tl.arange(0, BLOCK_HALF)[None, None, :]
    valid = (h < heads) & (j < head_dim // GROUP) & (i < HALF)
    src = x_ptr + h.to(tl.int64) * stride_h + j * GROUP + i
    lo = tl.load(src, mask=valid, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF, mask=valid, other=0.0).to(tl.float32)

    amax = tl.maximum(tl.max(tl.abs(lo), 2), tl.max(tl.abs(hi), 2))  # [H, G]
    # The first element (in the group's element order) of that magnitude, and its sign.
    at_lo = (tl.abs(lo) == amax[:, :, None]) & valid
    at_hi = (tl.abs(hi) == amax[:, :, None]) & valid
    first = tl.minimum(tl.min(tl.where(at_lo, i, GROUP), 2),
                       tl.min(tl.where(at_hi, i + HALF, GROUP), 2))[:, :, None]
    neg_lo = at_lo & (i == first) & (lo.to(tl.int32, bitcast=True) < 0)
    neg_hi = at_hi & (i + HALF == first) & (hi.to(tl.int32, bitcast=True) < 0)
    neg = (tl.max(neg_lo.to(tl.int32), 2) + tl.max(neg_hi.to(tl.int32), 2)) > 0
    scale = (tl.where(neg, -amax, amax) * -0.125).to(tl.float16)  # [H, G]
    sf = scale.to(tl.float32)
    zero = sf == 0.0
    inv = tl.where(zero, 0.0, tl.math.div_rn(1.0, tl.where(zero, 1.0, sf)))[:, :, None]
    q_lo = tl.clamp(tl.floor((lo * inv + 8.0) + 0.5), 0.0, 15.0).to(tl.int32)
    q_hi = tl.clamp(tl.floor((hi * inv + 8.0) + 0.5), 0.0, 15.0).to(tl.int32)
    packed = (q_lo | (q_hi << 4)).to(tl.uint8)
    row = rows.to(tl.int64)[:, None, None]
    tl.store(cache_ptr + row + j * HALF + i, packed, mask=valid)

    bits = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [H, G]
    row2 = rows.to(tl.int64)[:, None]
    j2 = tl.arange(0, BLOCK_G)[None, :]
    s_off = row2 + head_dim // 2 + 2 * j2
    s_mask = (tl.arange(0, BLOCK_H)[:, None] < heads) & (j2 < head_dim // GROUP)
    tl.store(cache_ptr + s_off, (bits & 0xFF).to(tl.uint8), mask=s_mask)
    tl.store(cache_ptr + s_off + 1, (bits >> 8).to(tl.uint8), mask=s_mask)


@triton.jit
def load_int4(cache_ptr, rows, d, mask, head_dim, GROUP: tl.constexpr):
    """Elements ``d`` of the int4 rows at byte offsets ``rows`` (``rows`` and ``d``
    broadcast against each other and ``mask``), dequantised to float32 as
    ``scale * (code - 8)``; masked elements are 0. Each element gathers its code's byte and its
    group's two scale bytes (neighbouring elements share them, so the loads hit the same cache
    lines)."""
    HALF: tl.constexpr = GROUP // 2
    j = d // GROUP
    e = d % GROUP
    byte = tl.load(cache_ptr + rows + j * HALF + e % HALF, mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((e // HALF) * 4)) & 15
    s_off = cache_ptr + rows + head_dim // 2 + 2 * j
    s_lo = tl.load(s_off, mask=mask, other=0).to(tl.int32)
    s_hi = tl.load(s_off + 1, mask=mask, other=0).to(tl.int32)
    scale = (s_lo | (s_hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    return (code - 8).to(tl.float32) * scale.to(tl.float32)
