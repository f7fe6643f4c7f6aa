"""The quantised KV pool layouts as the Triton kernels see them (defined, and implemented for
PyTorch, in engine/kv_format/formats.py; kvserve_kernels/ does not import engine/).

* kind 0: a float pool, rows of ``head_dim`` elements.
* kind 1: int8, rows of ``head_dim`` values then the row's float16 scale; the kernels read a row
  starting at (even) int8 element ``r`` through the float16 view at ``(r + head_dim) // 2``.
* kind 2: fp8 (e4m3fn or e5m2), rows of ``head_dim`` values and one float32 scale per KV head
  held outside the pool (the attention layer's ``kv_scales``).
* kind 3: int4, a uint8 pool; a row (:func:`kv_row_width`) is ``head_dim / 2`` bytes of codes
  (group ``j``'s byte ``i``: element ``j*g + i`` low nibble, ``j*g + i + g/2`` high, ``g`` =
  :func:`int4_group`) then one little-endian float16 scale per group at ``head_dim/2 + 2j``,
  read byte by byte (no alignment assumed); an element is ``scale * (code - 8)``. The values
  are the rows rotated per group (Walsh-Hadamard): the kernels never rotate, the attention
  backend hands them rotated K, V and queries and rotates the output back. The jit helpers
  that pack and unpack these rows are in kvserve_kernels/int4_rows.py."""

from __future__ import annotations

import functools

import torch

INT8_SCALE_BYTES = 2
INT4_GROUP = 32  # engine/kv_format/formats.py: the same


def kv_quant_kind(cache: torch.Tensor) -> int:
    """0 (float), 1 (int8 with row scales), 2 (fp8) or 3 (int4, uint8 bytes) for a pool."""
    if cache.dtype == torch.int8:
        return 1
    if cache.dtype == torch.uint8:
        return 3
    if cache.dtype.itemsize == 1 and cache.dtype.is_floating_point:
        return 2
    return 0


def int4_group(head_dim: int) -> int:
    """Elements per int4 scale: 32, or the whole row when ``head_dim`` is not a multiple of 32
    (``head_dim`` must be even)."""
    if head_dim % 2:
        raise ValueError(f"an int4 KV pool needs an even head_dim; got {head_dim}")
    return INT4_GROUP if head_dim % INT4_GROUP == 0 else head_dim


def kv_row_width(kind: int, head_dim: int) -> int:
    """Elements of the pool's dtype per (token, KV head) row for a pool of ``kind``."""
    if kind == 1:
        return head_dim + INT8_SCALE_BYTES
    if kind == 3:
        return head_dim // 2 + 2 * (head_dim // int4_group(head_dim))
    return head_dim


def byte_view(pool: torch.Tensor) -> torch.Tensor:
    """``pool``, or for fp8 its uint8 view (for moves of bytes that PyTorch cannot index)."""
    return pool.view(torch.uint8) if kv_quant_kind(pool) == 2 else pool


@functools.lru_cache(maxsize=32)
def unit_scales(num_kv_heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head fp8 scales of 1.0 (an uncalibrated fp8 pool), cached per shape and device."""
    one = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    return one, one
