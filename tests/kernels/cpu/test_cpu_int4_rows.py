"""The C++ int4 row writer (engine/cpu/csrc/int4_rows_cpu.cpp) against engine/kv_format/formats.py:
the decode stack stores its rows and rotates its queries with it, and must stay bit-identical to
the Python path, so both functions are held to torch.equal."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.kernels import load
from engine.kv_format.formats import int4_rotate, kv_format, quantize_rows


@pytest.fixture(scope="module")
def kernel():
    module = load()
    assert module is not None, "the CPU kernels failed to build (see the warning)"
    return module


@pytest.mark.parametrize("head_dim", [64, 16, 24])  # groups of 32, one of 16, one of 24 (no R)
def test_rotate_and_rows_are_bit_identical(kernel, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(7, 3, head_dim, generator=gen) * torch.logspace(-6, 3, 7).view(7, 1, 1)
    x[0, 0] = 0.0  # a zero group: scale 0, every nibble 8
    x[1, 0, :4] = 5.0  # ties: the first largest value sets the scale
    x[1, 1, 1] = -x[1, 1].abs().max() * 2  # a negative extreme
    x[2] = x[2].half().float()  # exactly representable values (rounding ties in the grid)
    fmt = kv_format("int4", torch.float32, head_dim)
    assert torch.equal(kernel.int4_rotate_cpu(x), int4_rotate(x))
    assert torch.equal(kernel.int4_quantize_rows_cpu(x), quantize_rows(x, fmt))
    view = x.transpose(0, 1)  # a strided input, as the stack's K/V views are
    assert torch.equal(kernel.int4_quantize_rows_cpu(view), quantize_rows(view, fmt))
