"""Triton kernel writing a step's new keys/values into their paged-pool slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: all KV heads of the token move together ([BLOCK_H, BLOCK_D] tile).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot < 0 means "padding token": no head is in range, so every store is a no-op.
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (h[:, None] < heads) & (d[None, :] < head_dim)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kc_blk + off * stride_kc_slot
    vc = v_cache_ptr + blk * stride_vc_blk + off * stride_vc_slot
    tl.store(kc + h[:, None] * stride_kc_h + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + h[:, None] * stride_vc_h + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, KVH, D]`` into the pools ``[NB, BS, KVH, D]`` at
    ``slot_mapping`` ``[T]`` (int64; -1 = skip), in place, casting to the pools' dtype.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV projection) as long as
    the last dimension is contiguous. Slots must be distinct and within the pool.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, KVH, D]; got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"pools {tuple(k_cache.shape)} do not hold [*, *, KVH, D] = "
                         f"{tuple(key.shape[1:])}")
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
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
