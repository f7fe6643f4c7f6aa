"""Quantise float weights on load (``quantization="int4" | "int8"``) onto the packed forms.

Round-to-nearest, per output row and group of ``group_size`` (32 or 128) input elements:

* ``int4``: asymmetric, ``d = (max - min) / 15``, ``m = min``, ``q = round((w - m) / d)`` in
  0..15, so ``w ~ d * q + m`` (GGUF's Q4_1 scheme) onto :class:`PackedQ4`. Each element's
  error is at most ``d / 2`` (plus float rounding); a constant group is exact.
* ``int8``: symmetric, ``d = amax / 127``, ``q = round(w / d)`` in -127..127, onto
  :class:`PackedQ8` (GGUF's Q8_0 scheme); error at most ``d / 2``.

The packed forms keep one scale (and min) per 32 elements, the kernels' group: with
``group_size=128`` each group's scale is repeated over its four groups of 32, so the values are
those of 128-wide groups (coarser rounding, the convention of AWQ/GPTQ-style checkpoints) but
the resident bytes are those of group 32. A weight whose width is not a multiple of
``group_size`` cannot be quantised (:func:`quantise` raises ValueError; callers keep it float).
"""

from __future__ import annotations

import torch

from engine.quantization.formats import GROUP, Packed, PackedQ4, PackedQ8

SCHEMES = ("int4", "int8")
GROUP_SIZES = (32, 128)


@torch.no_grad()
def quantise(weight: torch.Tensor, scheme: str, group_size: int = GROUP) -> Packed:
    """``weight [N, K]`` (any float dtype) as a packed weight of ``scheme`` (see the module
    docstring). Does not change ``weight``."""
    if scheme not in SCHEMES or group_size not in GROUP_SIZES:
        raise ValueError(f"cannot quantise to {scheme!r} with groups of {group_size}")
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"a weight of width {k} does not split into groups of {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    repeat = group_size // GROUP
    if scheme == "int4":
        lo, hi = w.amin(-1), w.amax(-1)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.clamp(torch.round((w - lo[..., None]) * inv[..., None]), 0, 15).to(torch.uint8)
        q = q.reshape(n, k // GROUP, GROUP)
        qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)  # GGUF's nibble order
        return PackedQ4(qs.contiguous(), _per32(d, repeat), _per32(lo, repeat))
    d = w.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.round(w * inv[..., None]), -127, 127).to(torch.int8)
    return PackedQ8(q.reshape(n, k).contiguous(), _per32(d, repeat))


def _per32(v: torch.Tensor, repeat: int) -> torch.Tensor:
    """Per-group values ``[N, K/group]`` as one per group of 32 ``[N, K/32]`` (float32)."""
    return v.repeat_interleave(repeat, dim=1).contiguous() if repeat > 1 else v.contiguous()
