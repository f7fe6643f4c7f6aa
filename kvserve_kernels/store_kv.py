"""Triton kernel writing a step's new keys/values into their paged-pool slots.

Over an 8-bit pool it quantises as it writes (the format of engine/kv_format/formats.py):
int8 rows are ``head_dim`` values ``round(x / s)`` (half away from zero, clamped to +-127) then
the float16 bits of ``s = max(absmax / 127, 2**-14)``, one scale per token and KV head; fp8
rows are ``x / head_scale`` saturated to the format's largest number. Over an int4 pool (a
uint8 pool of 4-bit codes and per-group float16 scales) it packs the rows the caller has already
rotated, exactly as the PyTorch format does (kvserve_kernels/int4_rows.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve_kernels.int4_rows import pack_int4_rows
from kvserve_kernels.kv_quant_layout import int4_group, kv_quant_kind, kv_row_width, unit_scales


# Every integer argument is fixed per model (strides of the fused QKV views and pools, head
# counts), so none varies while serving. The slot mapping is read one scalar per program:
# its alignment buys nothing, so a slice at any offset must not make a new variant.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_blk, stride_kc_slot, stride_kc_h,
    stride_vc_blk, stride_vc_slot, stride_vc_h,
    num_kv_heads, head_dim,
    k_scale_ptr, v_scale_ptr, fp8_max,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token: all KV heads of the token move together ([BLOCK_H, BLOCK_D] tile).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    # slot < 0 means "padding token": no head is in range, so every store is a no-op.
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    k_rows = blk * stride_kc_blk + off * stride_kc_slot + h * stride_kc_h  # [BLOCK_H]
    v_rows = blk * stride_vc_blk + off * stride_vc_slot + h * stride_vc_h
    if KV_QUANT == 3:  # int4: [head, group, code pair] tiles of their own
        pack_int4_rows(key_ptr + t * stride_kt, stride_kh, k_cache_ptr, k_rows, heads,
                       head_dim, BLOCK_H, BLOCK_G, BLOCK_HALF, GROUP)
        pack_int4_rows(value_ptr + t * stride_vt, stride_vh, v_cache_ptr, v_rows, heads,
                       head_dim, BLOCK_H, BLOCK_G, BLOCK_HALF, GROUP)
    else:
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < heads) & (d[None, :] < head_dim)
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask,
                    other=0.0)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask,
                    other=0.0)
        if KV_QUANT == 1:  # int8 + a float16 scale per row; k_scale_ptr = the pool's fp16 view
            k = _quantize_int8(k.to(tl.float32), k_scale_ptr, k_rows, head_dim, h < heads)
            v = _quantize_int8(v.to(tl.float32), v_scale_ptr, v_rows, head_dim, h < heads)
        elif KV_QUANT == 2:  # fp8 with a per-head scale
            ks = tl.load(k_scale_ptr + h, mask=h < num_kv_heads, other=1.0)
            vs = tl.load(v_scale_ptr + h, mask=h < num_kv_heads, other=1.0)
            k = tl.clamp(tl.math.div_rn(k.to(tl.float32), ks[:, None]), -fp8_max, fp8_max)
            v = tl.clamp(tl.math.div_rn(v.to(tl.float32), vs[:, None]), -fp8_max, fp8_max)
        tl.store(k_cache_ptr + k_rows[:, None] + d[None, :],
                 k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + v_rows[:, None] + d[None, :],
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_int8(x, scale_ptr, rows, head_dim, row_mask):
    """``x`` ``[H, D]`` fp32 (masked lanes 0) -> int8-valued fp32; stores each row's float16
    scale at fp16 index ``(rows + head_dim) // 2`` (just after the row's values). Divisions
    here and for fp8 are ``div_rn`` (rounded to nearest, as PyTorch's): a plain float32 ``/``
    is ``div.full.f32`` on NVIDIA GPUs (within 2 ulp), enough to cross a rounding boundary."""
    s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 1), 127.0), 6.103515625e-05)  # 2**-14
    s16 = s.to(tl.float16)
    tl.store(scale_ptr + (rows + head_dim) // 2, s16, mask=row_mask)
    y = tl.math.div_rn(x, s16.to(tl.float32)[:, None])
    y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
    return tl.clamp(y, -127.0, 127.0)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write ``key``/``value`` ``[T, KVH, D]`` into the pools ``[NB, BS, KVH, W]`` at
    ``slot_mapping`` ``[T]`` (int64; -1 = skip), in place, casting to the pools' dtype
    (``W = D``), or quantising into an int8 pool (``W = D + 2``: values, then the row's float16
    scale), an fp8 pool (``kv_scales``: per-head float32 ``[KVH]`` K and V scales, None = 1) or
    an int4 pool (uint8, ``W = D/2 + 2 * groups``: kvserve_kernels/kv_quant_layout.py; ``key``/``value``
    must be the ROTATED rows, best in float32, which this packs bit for bit as
    ``engine.kv_format.formats._quantize_int4`` does).

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV projection) as long as
    the last dimension is contiguous. Slots must be distinct and within the pool.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, KVH, D]; got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    quant = kv_quant_kind(k_cache)
    width = kv_row_width(quant, key.shape[2])
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (key.shape[1], width):
        raise ValueError(f"pools {tuple(k_cache.shape)} do not hold [*, *, KVH, D] = "
                         f"{tuple(key.shape[1:])} (rows of {width} elements)")
    num_tokens = key.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{num_tokens} tokens")
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV pools must be contiguous in head_dim")
    num_kv_heads, head_dim = key.shape[1:]
    k_scale = v_scale = k_cache  # unused unless quantised
    fp8_max = 0.0
    if quant == 1:
        k_scale, v_scale = k_cache.view(torch.float16), v_cache.view(torch.float16)
    elif quant == 2:
        fp8_max = float(torch.finfo(k_cache.dtype).max)
        if kv_scales is None:
            kv_scales = unit_scales(num_kv_heads, key.device)
        k_scale, v_scale = kv_scales
    group, block_g, block_half = 2, 1, 1  # read by int4 pools only
    if quant == 3:
        group = int4_group(head_dim)
        block_g = triton.next_power_of_2(head_dim // group)
        block_half = triton.next_power_of_2(group // 2)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        k_scale, v_scale, fp8_max,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_QUANT=quant, GROUP=group, BLOCK_G=block_g, BLOCK_HALF=block_half,
        # Each rounding on its own, as PyTorch does (int4: no FMA; kvserve_kernels/int4_rows.py).
        enable_fp_fusion=False,
    )
