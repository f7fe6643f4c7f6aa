"""``quant_gemm_q8_batch`` (engine/cpu/csrc/quant_gemm_q8_batch.cpp: 8-bit weights at decode-batch
sizes, the rows in a register's lanes, AVX-512 VNNI) and the ``q8_batch`` route of
``QuantLinear``: the decode kernels' integer math up to float order, each output in its own
fixed order (a row alone, or gathered weight rows, give the same bits), served from
``LANES_ROWS`` rows, never in batch-invariant mode."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.linear import (
    DENSE_ROWS,
    LANES_ROWS,
    QuantConcat,
    QuantLinear,
    quant_kernels,
    vnni_available,
)
from engine.quantization.rtn import quantise

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
needs_vnni = pytest.mark.skipif(not vnni_available(), reason="no AVX-512 VNNI kernels on this CPU")

# q8 layouts: a scale per 32 (Q8_0) or per 16 (Q6_K), with or without a min per scale group.
LAYOUTS = [(32, False), (16, False), (16, True), (32, True)]


def _q8(n: int, k: int, s: int, mins: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, k // s, generator=g) * 0.01
    m = (torch.rand(n, k // s, generator=g) - 0.5) * 0.01 if mins else None
    return qs, d, m


@needs_vnni
@pytest.mark.parametrize(("s", "mins"), LAYOUTS)
@pytest.mark.parametrize("n", [1, 6, 37])  # whole and partial groups of 4 outputs
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])  # one block of 16 lanes, partial, several
def test_the_decode_kernels_math_each_output_in_its_own_order(s, mins, n, rows):
    qs, d, m = _q8(n, 96, s, mins, seed=n + rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 2
    kern = quant_kernels()
    got = kern.quant_gemm_q8_batch(x, qs, d, m)
    want = kern.quant_gemm_q8(x, qs, d, m)
    scale = float((x.abs() @ (qs.float().abs() * 0.01).t()).max())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
    for r in {0, rows // 2, rows - 1}:  # a row alone: the same bits as in the batch
        assert torch.equal(kern.quant_gemm_q8_batch(x[r:r + 1], qs, d, m)[0], got[r])
    cols = torch.tensor([n - 1, 0, n // 2])  # gathered weight rows: the same bits
    part = kern.quant_gemm_q8_batch(x, qs[cols], d[cols], None if m is None else m[cols])
    assert torch.equal(part, got[:, cols])


def test_linear_serves_batches_on_the_lanes_where_set():
    """``choose(q8_batch="lanes")``: inputs of ``LANES_ROWS`` to ``dense_rows`` rows run the lanes
    kernel (bias added), fewer rows the decode kernel, more the dense path; ``forward_columns``
    follows the same route, bit for bit; batch-invariant mode leaves the lanes; 4-bit weights
    ignore it. Where VNNI is not built, ``lanes`` is refused."""
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(40, generator=g)
    lin = QuantLinear(quantise(torch.randn(40, 64, generator=g), "int8", 32), bias)
    x = torch.randn(DENSE_ROWS + 5, 64, generator=g)
    with pytest.raises(ValueError, match="8-bit batch path"):
        lin.choose(q8_batch="tiles")
    if not vnni_available():
        with pytest.raises(ValueError, match="not built"):
            lin.choose(q8_batch="lanes")
        return
    kern = quant_kernels()
    sizes = (1, LANES_ROWS - 1, LANES_ROWS, 16, DENSE_ROWS, DENSE_ROWS + 5)
    before = {n: lin(x[:n]) for n in sizes}
    QuantConcat([lin]).choose(q8_batch="lanes")
    assert lin.kernels.q8_batch == "lanes" and lin.lanes_from == LANES_ROWS
    cols = torch.tensor([39, 3, 17])
    for n in sizes:
        if LANES_ROWS <= n <= DENSE_ROWS:
            want = kern.quant_gemm_q8_batch(x[:n], lin.qs, lin.d, lin.m) + bias
            torch.testing.assert_close(want, before[n], rtol=0, atol=1e-4)
        else:
            want = before[n]
        assert torch.equal(lin(x[:n]), want), n
        if n <= DENSE_ROWS:
            assert torch.equal(lin.forward_columns(x[:n], cols), want[:, cols]), n
    lin.set_batch_invariant()
    assert lin.lanes_from is None
    assert torch.equal(lin(x[:16]), kern.quant_gemm_q8(x[:16], lin.qs, lin.d, lin.m) + bias)
    lin4 = QuantLinear(quantise(torch.randn(16, 64, generator=g), "int4", 32))
    lin4.choose(q8_batch="lanes")
    assert lin4.lanes_from is None
