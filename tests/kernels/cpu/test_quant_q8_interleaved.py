"""The interleaved layout of 8-bit weights (engine/quantization/interleaved.py) and
``quant_gemm_q8_interleaved`` (engine/cpu/csrc/quant_gemm_q8_interleaved.cpp, AVX-512 VNNI or
AVX2): the layout is an exact permutation (and a gather of outputs), the kernel gives
``quant_gemm_q8_batch``'s floats bit for bit at every row count on either instruction set (so
the decode kernels' integer math up to float order, weights of -128 included), and a row's
output does not depend on the other rows; ``QuantLinear``'s ``q8_layout`` route, lookups,
restricted head and batch-invariant mode over it."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.interleaved import (
    from_interleaved,
    gather_interleaved,
    gather_rows,
    to_interleaved,
)
from engine.quantization.linear import (
    DENSE_ROWS,
    QuantConcat,
    QuantEmbedding,
    QuantLinear,
    amx_available,
    interleaved_available,
    quant_kernels,
    vnni_available,
)
from engine.quantization.rtn import quantise

needs_kernel = pytest.mark.skipif(quant_kernels() is None or not interleaved_available(),
                                  reason="no AVX2 kernels on this CPU")

# q8 layouts: a scale per 32 (Q8_0) or per 16 (Q6_K), with or without a min per scale group.
LAYOUTS = [(32, False), (16, False), (16, True), (32, True)]


def _q8(n: int, k: int, s: int, mins: bool, seed: int = 0, half: bool = False):
    """A q8 weight; ``half``: its scales and mins float16 values (as a GGUF Q8_0's)."""
    g = torch.Generator().manual_seed(seed)
    qs = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    qs[0, :9] = torch.tensor([-127, 127, 0, -1, 1, 2, 64, -64, -128], dtype=torch.int8)
    d = torch.rand(n, k // s, generator=g) * 0.01
    m = (torch.rand(n, k // s, generator=g) - 0.5) * 0.01 if mins else None
    if half:
        d, m = d.half().float(), None if m is None else m.half().float()
    return qs, d, m


@pytest.mark.parametrize(("s", "mins"), LAYOUTS)
@pytest.mark.parametrize("n", [1, 15, 16, 37])
@pytest.mark.parametrize("half", [False, True])
def test_the_layout_is_an_exact_permutation(s, mins, n, half):
    """Bytes and scales permuted (float16 scales only where all are float16 values), and
    back, and gathered rows, exactly."""
    qs, d, m = _q8(n, 96, s, mins, seed=n, half=half)
    qi, di, mi = to_interleaved(qs, d, m)
    tiles = -(-n // 16)
    assert qi.dtype == torch.uint8 and qi.shape == (tiles, 16 * 96)
    assert di.shape == (tiles, 16 * (96 // s)) and (mi is None) == (m is None)
    assert di.dtype == (torch.float16 if half else torch.float32)
    assert mi is None or mi.dtype == di.dtype
    o, i = n - 1, 5  # byte 64 i + 4 o + j of tile t: W[16 t + o, 4 i + j] + 128
    t, lane = divmod(o, 16)
    assert int(qi[t, 64 * i + 4 * lane + 1]) == int(qs[o, 4 * i + 1]) + 128
    assert float(di[t, 16 * 2 + lane]) == float(d[o, 2])
    back = from_interleaved(qi, di, mi, n)
    assert torch.equal(back[0], qs) and torch.equal(back[1], d)
    assert m is None or torch.equal(back[2], m)
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    got = gather_rows(qi, di, mi, rows)
    assert torch.equal(got[0], qs[rows]) and torch.equal(got[1], d[rows])
    assert m is None or torch.equal(got[2], m[rows])
    gi = gather_interleaved(qi, di, mi, rows)  # those outputs as their own interleaved weight
    assert gi[0].shape == (1, 16 * 96) and gi[1].dtype == di.dtype
    back = from_interleaved(*gi, 4)
    assert torch.equal(back[0], qs[rows]) and torch.equal(back[1], d[rows])
    assert m is None or torch.equal(back[2], m[rows])


@needs_kernel
@pytest.mark.parametrize(("s", "mins"), LAYOUTS)
@pytest.mark.parametrize("n", [1, 15, 37])  # one partial tile, several
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 40])  # blocks of 8 (2 on AVX2)
@pytest.mark.parametrize("half", [False, True])  # the scales stored float32 or float16
def test_the_lanes_kernels_floats_at_every_row_count(s, mins, n, rows, half):
    """On VNNI (where built) and on AVX2 (``avx2=True``, or the only path): the same floats as
    each other and as the lanes kernel (VNNI only), the decode kernel's integers (a weight of
    -128 among them), a row alone the same bits as in the batch."""
    qs, d, m = _q8(n, 96, s, mins, seed=n + rows, half=half)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 2
    kern = quant_kernels()
    qi, di, mi = to_interleaved(qs, d, m)
    got = kern.quant_gemm_q8_interleaved(x, qi, di, mi, n)
    assert got.shape == (rows, n)
    assert torch.equal(kern.quant_gemm_q8_interleaved(x, qi, di, mi, n, avx2=True), got)
    if vnni_available():
        assert torch.equal(got, kern.quant_gemm_q8_batch(x, qs, d, m))
    want = kern.quant_gemm_q8(x, qs, d, m)  # the decode kernel: the same integers
    scale = float((x.abs() @ (qs.float().abs() * 0.01).t()).max())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
    for r in {0, rows // 2, rows - 1}:  # a row alone: the same bits as in the batch
        for avx2 in (False, True):
            alone = kern.quant_gemm_q8_interleaved(x[r:r + 1], qi, di, mi, n, avx2=avx2)
            assert torch.equal(alone[0], got[r])


@needs_kernel
def test_the_kernel_refuses_a_malformed_weight():
    qs, d, _ = _q8(20, 64, 32, False)
    qi, di, _ = to_interleaved(qs, d, None)
    kern = quant_kernels()
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="tiles"):
        kern.quant_gemm_q8_interleaved(x, qi, di, None, 40)  # 40 outputs need 3 tiles
    with pytest.raises(RuntimeError, match="columns"):
        kern.quant_gemm_q8_interleaved(torch.randn(2, 96), qi, di, None, 20)
    with pytest.raises(RuntimeError, match="malformed"):
        kern.quant_gemm_q8_interleaved(x, qs, d, None, 20)  # the rows layout


def test_linear_serves_every_size_on_the_interleaved_layout():
    """``choose(q8_layout="interleaved")``: inputs up to ``dense_rows`` rows run the interleaved
    kernel (bias added), more the dense path (panels dequantised from the layout, the same
    floats); ``dequantize_rows``, a tied embedding's lookups and ``forward_columns`` give the
    rows layout's numbers (the restricted head: the full head's columns, bit for bit); the
    lanes setting is moot; back to ``rows`` restores the bytes. Refused where the kernel is
    not built (no AVX2); 4-bit weights ignore it."""
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(40, generator=g)
    lin = QuantLinear(quantise(torch.randn(40, 64, generator=g), "int8", 32), bias)
    with pytest.raises(ValueError, match="8-bit layout"):
        lin.choose(q8_layout="blocked")
    if quant_kernels() is None or not interleaved_available():
        with pytest.raises(ValueError, match="not built"):
            lin.choose(q8_layout="interleaved")
        return
    kern = quant_kernels()
    x = torch.randn(DENSE_ROWS + 5, 64, generator=g)
    qs, ids = lin.qs.clone(), torch.tensor([[39, 0], [17, 17]])
    rows_before = lin.dequantize_rows(torch.arange(40))
    dense_before = lin(x)
    if vnni_available():
        lin.choose(q8_batch="lanes")
    QuantConcat([lin]).choose(q8_layout="interleaved")
    assert lin.interleaved and lin.lanes_from is None and "interleaved" in lin.extra_repr()
    assert torch.equal(lin.dequantize_rows(torch.arange(40)), rows_before)
    assert torch.equal(lin(x), dense_before)  # the dense path: panels from the layout
    cols = torch.tensor([39, 3, 17])
    for n in (1, 2, 9, 16, DENSE_ROWS):
        got = lin(x[:n])
        want = kern.quant_gemm_q8_interleaved(x[:n], lin.qs, lin.d, lin.m, 40) + bias
        assert torch.equal(got, want)
        assert torch.equal(lin.forward_columns(x[:n], cols), got[:, cols])
    assert lin.forward_columns(x, cols) is None  # the dense path is not gathered
    lin.set_batch_invariant()
    big = lin(x)
    assert torch.equal(big[:3], lin(x[:3])) and torch.equal(lin.forward_columns(x, cols),
                                                            big[:, cols])
    lin.choose(q8_layout="rows")
    assert torch.equal(lin.qs, qs) and not lin.interleaved
    emb = QuantEmbedding(quantise(torch.randn(40, 64, generator=g), "int8", 32))
    looked_up = emb(ids)
    emb.head.choose(q8_layout="interleaved")
    assert torch.equal(emb(ids), looked_up)
    q4 = QuantLinear(quantise(torch.randn(40, 64, generator=g), "int4", 32))
    q4.choose(q8_layout="interleaved")
    assert q4.kernels.q8_layout == "rows"


needs_amx = pytest.mark.skipif(quant_kernels() is None or not amx_available(),
                               reason="no AMX-INT8 tiles on this CPU (or the OS refused them)")


@needs_amx
@pytest.mark.parametrize(("s", "mins"), LAYOUTS)
@pytest.mark.parametrize("n", [1, 15, 37])
@pytest.mark.parametrize("rows", [1, 7, 8, 16, 17, 40])  # an A tile's 16 rows, padded, several
@pytest.mark.parametrize("half", [False, True])
def test_the_amx_tiles_give_the_vnni_floats(s, mins, n, rows, half):
    """``amx=True``: the VNNI path's floats bit for bit at every row count (the tile multiply's
    exact int32 sums, the same float epilogue in the same order), a row alone the same bits as
    in the batch."""
    qs, d, m = _q8(n, 96, s, mins, seed=n + rows, half=half)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 2
    kern = quant_kernels()
    qi, di, mi = to_interleaved(qs, d, m)
    want = kern.quant_gemm_q8_interleaved(x, qi, di, mi, n)
    assert torch.equal(kern.quant_gemm_q8_interleaved(x, qi, di, mi, n, amx=True), want)
    alone = kern.quant_gemm_q8_interleaved(x[-1:], qi, di, mi, n, amx=True)
    assert torch.equal(alone[0], want[-1])


def test_amx_tiles_are_refused_where_unavailable_and_serve_from_their_threshold():
    """``choose(q8_tiles="amx")`` is refused where the tiles are not available; where they are, an
    interleaved weight runs batches from ``amx_from`` (16 or 8) rows on them, the same floats;
    a weight in the rows layout never does."""
    g = torch.Generator().manual_seed(1)
    lin = QuantLinear(quantise(torch.randn(40, 64, generator=g), "int8", 32))
    with pytest.raises(ValueError, match="8-bit tiles"):
        lin.choose(q8_tiles="avx2")
    with pytest.raises(ValueError, match="AMX row threshold"):
        lin.choose(q8_amx_from="4")
    if quant_kernels() is None or not amx_available():
        with pytest.raises(ValueError, match="AMX tiles are not available"):
            lin.choose(q8_tiles="amx")
        if quant_kernels() is not None and interleaved_available():
            qi, di, _ = to_interleaved(lin.qs, lin.d, None)
            with pytest.raises(RuntimeError, match="AMX"):
                quant_kernels().quant_gemm_q8_interleaved(torch.randn(2, 64), qi, di, None, 40,
                                                          amx=True)
        return
    x = torch.randn(DENSE_ROWS, 64, generator=g)
    lin.choose(q8_tiles="amx")
    assert lin.amx_from is None  # rows layout
    lin.choose(q8_layout="interleaved")
    want = {n: lin(x[:n]) for n in (1, 8, 16, DENSE_ROWS)}
    assert lin.amx_from == 16
    lin.choose(q8_amx_from="8")
    assert lin.amx_from == 8 and lin._on_amx(8) and not lin._on_amx(7)
    for n, y in want.items():
        assert torch.equal(lin(x[:n]), y)
    lin.choose(q8_tiles="vnni")
    assert lin.amx_from is None
