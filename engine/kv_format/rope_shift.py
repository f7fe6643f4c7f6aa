"""Re-rotating cached keys to earlier positions (streaming eviction's K-shift).

K is stored after RoPE: a key of position ``p`` is ``R(p) k``. RoPE rotates each pair of
dimensions by ``p * inv_freq``, so ``R(-d) R(p) k = R(p - d) k``: rotating a stored key by
``-d`` gives exactly the key the model would have stored at ``p - d`` (up to rounding). In the
rotate-half layout, ``R(-d)`` is ``x * cos(d) - rotate_half(x) * sin(d)``, i.e. the model's own
``apply_rotary`` with ``sin`` negated, the cos/sin of ``d`` read from its RoPE table (the
same frequencies, scaling included, as the keys were rotated with).

8-bit pools are dequantised, rotated and requantised (int8: a fresh scale per row; fp8: the
layer's per-head scale): each shift adds one rounding of the format, and a key is shifted once
per evicted block while it lives in the window. Float pools are rotated in float32 and rounded
once to their dtype per shift.
"""

from __future__ import annotations

import torch

from engine.kv_format.formats import KVFormat, byte_view, dequantize_rows, quantize_rows


def rotate_back(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` rotated by the NEGATIVE of the angles whose ``cos``/``sin`` ``[D]`` are
    given (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos - rotated * sin


def shift_block_keys(k_pool: torch.Tensor, block_ids: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, fmt: KVFormat,
                     scale: torch.Tensor | None = None) -> None:
    """Re-rotate, in place, the K rows of whole blocks ``block_ids`` (int64, distinct) of one
    layer's pool ``[num_blocks, block_size, KVH, row_width]`` by ``-d``, ``cos``/``sin``
    ``[D]`` being those of ``d``. ``scale``: the fp8 per-head K scale (None: 1.0). Slots of
    those blocks that hold no key yet are rotated too (harmless: written before read)."""
    if block_ids.numel() == 0:
        return
    view = byte_view(k_pool)
    rows = view[block_ids].view(k_pool.dtype)
    x = dequantize_rows(rows, fmt, torch.float32, scale)
    y = rotate_back(x, cos.float(), sin.float())
    new = quantize_rows(y, fmt, scale)
    view[block_ids] = byte_view(new) if new.dtype != view.dtype else new
