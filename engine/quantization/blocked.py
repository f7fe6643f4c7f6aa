"""The blocked layout of a 4-bit weight, and back: ``to_blocked`` / ``from_blocked``.

The rows layout (``PackedQ4``: ``qs`` uint8 ``[N, K/2]``, ``d``, ``m`` float32 ``[N, K/32]``)
keeps each output column's groups together, as GGUF does. The blocked layout keeps 8 columns'
groups interleaved so that one 32-byte load holds 8 columns x 4 k
(engine/cpu/csrc/quant_gemm_q4_blocked.cpp states it byte by byte):

* ``qs`` uint8 ``[NB, G, 128]`` with ``NB = ceil(N / 8)``: block ``b``, group ``g``, bytes
  ``32 j + 4 c + i`` = rows-layout byte ``4 j + i`` of column ``8 b + c``'s group ``g``;
* ``d``, ``m`` ``[NB, G, 8]``, in the smallest format that holds them exactly
  (:func:`compact_scales`): float16 ``d`` and an empty ``m`` where ``m = -8 d`` (Q4_0), float16
  ``d`` and ``m`` where both are float16 values (Q4_1), else float32; the kernel widens them to
  the same float32 values.
The last block's missing columns are zeros. Both directions are exact (a permutation of
bytes and floats plus that padding) and cost one copy of the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

COLS = 8  # output columns per block
QUADS = 4  # 4-byte quads per column and group


def to_blocked(qs: torch.Tensor, d: torch.Tensor,
               m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows layout ``(qs [N, K/2], d [N, G], m [N, G])`` -> blocked ``(qs, d, m)``."""
    n, half = qs.shape
    g = half // 16
    pad = -n % COLS
    nb = (n + pad) // COLS
    q = F.pad(qs, (0, 0, 0, pad)).view(nb, COLS, g, QUADS, 4).permute(0, 2, 3, 1, 4)
    d, m = compact_scales(_scales_to_blocked(d, pad), _scales_to_blocked(m, pad))
    return q.contiguous().view(nb, g, COLS * QUADS * 4), d, m


def compact_scales(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 blocked ``(d, m)`` in the smallest exact format (module docstring)."""
    d16 = d.half()
    if not torch.equal(d16.float(), d):
        return d, m
    if torch.equal(m, d * -8.0):
        return d16, d16.new_empty((*d.shape[:2], 0))
    m16 = m.half()
    if torch.equal(m16.float(), m):
        return d16, m16
    return d, m


def expand_scales(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked ``(d, m)`` of any format as float32 ``[NB, G, 8]`` both (exact)."""
    d32 = d.float()
    return d32, (d32 * -8.0 if m.shape[-1] == 0 else m.float())


def from_blocked(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocked ``(qs [NB, G, 128], d, m)`` of ``n`` columns -> rows layout ``(qs, d, m)``."""
    nb, g, _ = qs.shape
    q = qs.view(nb, g, QUADS, COLS, 4).permute(0, 3, 1, 2, 4).reshape(nb * COLS, g * 16)
    d, m = expand_scales(d, m)
    return (q[:n].contiguous(), _scales_from_blocked(d, n), _scales_from_blocked(m, n))


def _scales_to_blocked(s: torch.Tensor, pad: int) -> torch.Tensor:
    n, g = s.shape
    return F.pad(s, (0, 0, 0, pad)).view(-1, COLS, g).transpose(1, 2).contiguous()


def _scales_from_blocked(s: torch.Tensor, n: int) -> torch.Tensor:
    nb, g, _ = s.shape
    return s.transpose(1, 2).reshape(nb * COLS, g)[:n].contiguous()
