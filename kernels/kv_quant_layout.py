"""The 8-bit KV pool layouts as the Triton kernels see them (the format itself is defined, and
implemented for PyTorch, in engine/kv_storage/formats.py; kernels/ does not import engine/).

* kind 0: a float pool, rows of ``head_dim`` elements.
* kind 1: int8, rows of ``head_dim`` values then the two bytes of the row's float16 scale. The
  kernels read the scales through the pool's float16 view: a row starting at int8 element
  ``r`` (always even, since the row width ``head_dim + 2`` is) keeps its scale at float16
  index ``(r + head_dim) // 2``.
* kind 2: fp8 (e4m3fn or e5m2), rows of ``head_dim`` values and one float32 scale per KV head
  held outside the pool (the attention layer's ``kv_scales``).
"""

from __future__ import annotations

import functools

import torch

INT8_SCALE_BYTES = 2


def kv_quant_kind(cache: torch.Tensor) -> int:
    """0 (float), 1 (int8 with row scales) or 2 (fp8) for a pool tensor."""
    if cache.dtype == torch.int8:
        return 1
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        return 2
    return 0


def byte_view(pool: torch.Tensor) -> torch.Tensor:
    """``pool``, or for fp8 its uint8 view (for moves of bytes that PyTorch cannot index)."""
    return pool.view(torch.uint8) if kv_quant_kind(pool) == 2 else pool


@functools.lru_cache(maxsize=32)
def unit_scales(num_kv_heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head fp8 scales of 1.0 (an uncalibrated fp8 pool), cached per shape and device."""
    one = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    return one, one
