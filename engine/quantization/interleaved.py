"""The interleaved layout of an 8-bit weight, and back: ``to_interleaved`` / ``from_interleaved``.

The rows layout (``PackedQ8``: ``qs`` int8 ``[N, K]``, ``d`` and an optional ``m`` float32
``[N, K/S]``, ``S`` 16 or 32) keeps each output's weights together. The interleaved layout keeps
16 outputs' weights interleaved by 4 bytes, so one 64-byte load holds 16 outputs x 4 k
(engine/cpu/csrc/quant_gemm_q8_interleaved.cpp):

* ``qs`` uint8 ``[T, 16 K]`` with ``T = ceil(N / 16)``: tile ``t``, byte ``64 i + 4 o + j`` =
  ``W[16 t + o, 4 i + j] + 128`` (the sign bit flipped: the kernel's dot product multiplies
  unsigned weights by signed activations);
* ``d``, ``m`` ``[T, 16 K/S]``: tile ``t``, element ``16 h + o`` = the scale (min) of output
  ``16 t + o``'s scale group ``h``; float16 where every one is a float16 value (a GGUF Q8_0's),
  else float32; the kernel widens them to the same float32 values.
The last tile's missing outputs have zero weights and scales. Both directions are exact (a
permutation of bytes and floats plus that padding) and cost one copy of the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

OUTS = 16  # outputs per tile
QUAD = 4  # bytes of one output per 64-byte step


def to_interleaved(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows layout ``(qs int8 [N, K], d [N, D], m [N, D] or None)`` -> interleaved."""
    pad = -qs.shape[0] % OUTS
    q = _tiles(qs).view(torch.uint8)
    q.bitwise_xor_(0x80)
    d, m = _scales_to(d, pad), None if m is None else _scales_to(m, pad)
    if all(_is_half(s) for s in (d, m) if s is not None):
        d, m = d.half(), None if m is None else m.half()
    return q, d, m


def from_interleaved(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, n: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Interleaved ``(qs, d, m)`` of ``n`` outputs -> the rows layout, exactly."""
    t, width = qs.shape
    k = width // OUTS
    # a copy (the permutation is not a view), so the XOR below leaves qs alone; its first n
    # rows are contiguous
    q = qs.view(t, k // QUAD, OUTS, QUAD).permute(0, 2, 1, 3).contiguous().view(t * OUTS, k)[:n]
    q.bitwise_xor_(0x80)

    def scales(s: torch.Tensor) -> torch.Tensor:
        return s.view(t, -1, OUTS).transpose(1, 2).reshape(t * OUTS, -1)[:n].float().contiguous()

    return q.view(torch.int8), scales(d), None if m is None else scales(m)


def gather_rows(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Outputs ``rows`` (int64, each below the weight's output count) of an interleaved weight,
    in the rows layout ``(qs int8 [len(rows), K], d, m)``, exactly."""
    t, width = qs.shape
    k = width // OUTS
    tile, lane = rows // OUTS, rows % OUTS
    q = qs.view(t, k // QUAD, OUTS, QUAD)[tile, :, lane, :]  # [rows, K/4, 4]
    q = (q ^ 0x80).reshape(rows.numel(), k).view(torch.int8)
    return q, _scales_rows(d, tile, lane), None if m is None else _scales_rows(m, tile, lane)


def gather_interleaved(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                       rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Outputs ``rows`` (int64, each below the weight's output count) of an interleaved weight
    as an interleaved weight of ``len(rows)`` outputs (its own tiles, the scales' dtype kept),
    exactly: ``quant_gemm_q8_interleaved`` over it gives those outputs' floats bit for bit."""
    t, width = qs.shape
    k = width // OUTS
    tile, lane = rows // OUTS, rows % OUTS
    pad = -rows.numel() % OUTS
    q = _tiles(qs.view(t, k // QUAD, OUTS, QUAD)[tile, :, lane, :].reshape(rows.numel(), k))

    def scales(s: torch.Tensor) -> torch.Tensor:
        return _scales_to(_picked(s, tile, lane), pad)

    return q, scales(d), None if m is None else scales(m)


def _tiles(q: torch.Tensor) -> torch.Tensor:
    """Bytes ``[n, K]`` in the rows layout -> ``[T, 16 K]`` tiles (zero rows pad the last),
    the bytes as they are."""
    n, k = q.shape
    pad = -n % OUTS
    t = (n + pad) // OUTS
    q = (F.pad(q, (0, 0, 0, pad)) if pad else q).view(t, OUTS, k // QUAD, QUAD)
    return q.permute(0, 2, 1, 3).contiguous().view(t, OUTS * k)


def _is_half(s: torch.Tensor) -> bool:
    """Whether every element of float32 ``s`` is a float16 value (converts there and back)."""
    return bool(torch.equal(s.half().float(), s))


def _scales_to(s: torch.Tensor, pad: int) -> torch.Tensor:
    n, groups = s.shape
    t = (n + pad) // OUTS
    return F.pad(s, (0, 0, 0, pad)).view(t, OUTS, groups).transpose(1, 2).reshape(t, groups * OUTS)


def _picked(s: torch.Tensor, tile: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """The scales (or mins) ``[len(tile), K/S]`` of outputs ``16 tile + lane``."""
    t, width = s.shape
    return s.view(t, width // OUTS, OUTS)[tile, :, lane]


def _scales_rows(s: torch.Tensor, tile: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    return _picked(s, tile, lane).float().contiguous()
