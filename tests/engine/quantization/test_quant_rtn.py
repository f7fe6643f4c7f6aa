"""Quantise-on-load (engine/quantization/rtn.py) for ``--quantization int4|int8``.

Truth: the definition of round-to-nearest per group, computed here in float64 from the float
weight: the packed weight must dequantise to within half a quantisation step of it, reproduce
each group's range (int4: min and max exactly up to float rounding), and a packed linear over
it must equal ``F.linear`` over that dequantised weight (tests/engine/quantization/test_quant_formats.py bounds
the kernels' activation rounding; here a loose check that the wiring is right).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.quantization.formats import PackedQ4, PackedQ8
from engine.quantization.linear import QuantLinear, quant_kernels
from engine.quantization.rtn import quantise


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 2 + \
        torch.randn(n, 1, generator=g) * 0.1  # rows with an offset: asymmetric groups


def _groups(w: torch.Tensor, size: int) -> torch.Tensor:
    return w.double().view(w.shape[0], -1, size)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("shape", [(1, 128), (7, 256), (33, 384)])
def test_int4_is_round_to_nearest_with_scale_and_min(shape, group):
    w = _weight(*shape)
    p = quantise(w, "int4", group)
    assert isinstance(p, PackedQ4) and p.shape == shape and p.d.shape == (shape[0], shape[1] // 32)
    got = _groups(p.dequantize(), group)
    ref = _groups(w, group)
    step = (ref.amax(-1) - ref.amin(-1)) / 15
    assert bool(((got - ref).abs() <= step[..., None] / 2 + 1e-5).all())
    tol = 1e-5 * float(ref.abs().max())
    torch.testing.assert_close(got.amin(-1), ref.amin(-1), rtol=0, atol=tol)
    torch.testing.assert_close(got.amax(-1), ref.amax(-1), rtol=0, atol=tol)


@pytest.mark.parametrize("group", [32, 128])
def test_int8_is_symmetric_round_to_nearest(group):
    w = _weight(9, 256, seed=1)
    p = quantise(w, "int8", group)
    assert isinstance(p, PackedQ8) and p.m is None and p.scale_group == 32
    assert int(p.qs.abs().max()) == 127
    got, ref = _groups(p.dequantize(), group), _groups(w, group)
    step = ref.abs().amax(-1) / 127
    assert bool(((got - ref).abs() <= step[..., None] / 2 + 1e-6).all())


def test_group_128_repeats_its_scale_over_four_groups_of_32():
    w = _weight(4, 256, seed=2)
    p32, p128 = quantise(w, "int4", 32), quantise(w, "int4", 128)
    assert p128.nbytes == p32.nbytes  # the packed form's scales are per 32 either way
    assert torch.equal(p128.d.view(4, 2, 4), p128.d.view(4, 2, 4)[..., :1].expand(4, 2, 4))
    err32 = (p32.dequantize() - w).abs().mean()
    err128 = (p128.dequantize() - w).abs().mean()
    assert err128 > err32  # coarser groups round coarser


def test_constant_and_zero_groups_are_exact():
    w = torch.zeros(2, 64)
    w[1, :32] = 0.75
    for scheme in ("int4", "int8"):
        assert torch.equal(quantise(w, scheme).dequantize(), w)


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="groups of 32"):
        quantise(torch.zeros(2, 48), "int4")
    with pytest.raises(ValueError):
        quantise(torch.zeros(2, 64), "int2")
    with pytest.raises(ValueError):
        quantise(torch.zeros(2, 128), "int8", 64)


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 17, 300])
def test_packed_linear_over_quantised_weights(scheme, rows):
    w = _weight(40, 160, seed=3)
    p = quantise(w, scheme)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    ref = F.linear(x.double(), p.dequantize().double())
    scale = float((x.abs() @ w.abs().t()).max())
    torch.testing.assert_close(QuantLinear(p)(x).double(), ref, rtol=0, atol=0.02 * scale)
