"""The blocked layout of 4-bit weights (engine/quantization/blocked.py) and its kernel
``quant_gemm_q4_blocked``: the conversion is exact both ways, the kernel does the tiled
kernel's math bit for bit (and so the decode kernel's up to float summation order, and the
reference model of that math), dequantised rows equal the rows layout's, and ``QuantLinear``
serves every row count from the blocked weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf import quants

from engine.quantization.blocked import from_blocked, to_blocked
from engine.quantization.gguf_blocks import from_gguf_blocks
from engine.quantization.linear import (
    DENSE_ROWS,
    Q4_AMX_FROM,
    QuantConcat,
    QuantEmbedding,
    QuantLinear,
    amx_available,
    quant_kernels,
    vnni_available,
)
from engine.quantization.rtn import quantise

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")


# The three scale formats of the blocked layout (blocked.compact_scales): a GGUF Q4_0
# (float16 d, m = -8 d not stored), a GGUF Q4_1 (float16 d and m), kvserve's own int4
# quantisation of a float weight (float32 d and m).
FORMATS = ("q4_0", "q4_1", "rtn")


def _q4(n: int, k: int, seed: int = 0, fmt: str = "q4_1"):
    """A 4-bit weight (Q4_1: mins not zero) as packed rows, and its dequantised float values."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + 0.01).astype(np.float32)
    if fmt == "rtn":
        packed = quantise(torch.from_numpy(w), "int4", 32)
        return packed, packed.dequantize()
    t = T.Q4_0 if fmt == "q4_0" else T.Q4_1
    raw = quants.quantize(w, t)
    return (from_gguf_blocks(raw, int(t), (n, k)),
            torch.from_numpy(quants.dequantize(raw, t)).float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_are_stored_in_the_smallest_exact_format(fmt):
    """GGUF Q4_0 keeps 18 bytes per 32 weights blocked (as the file), Q4_1 20, float32 scales
    24; every format converts back to the rows layout exactly."""
    packed, _ = _q4(40, 96, fmt=fmt)
    qs, d, m = to_blocked(packed.qs, packed.d, packed.m)
    want = {"q4_0": (torch.float16, 0), "q4_1": (torch.float16, 8), "rtn": (torch.float32, 8)}
    assert (d.dtype, m.shape[-1]) == want[fmt] and m.dtype == d.dtype
    per_32 = sum(t.numel() * t.element_size() for t in (qs, d, m)) / (40 * 96 / 32)
    assert per_32 == {"q4_0": 18, "q4_1": 20, "rtn": 24}[fmt]
    for a, b in zip(from_blocked(qs, d, m, 40), (packed.qs, packed.d, packed.m)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if fmt != "rtn":  # a scale that float16 cannot hold keeps the float32 format
        d2 = packed.d.clone()
        d2[3, 1] = 1 + 2 ** -20
        assert to_blocked(packed.qs, d2, packed.m)[1].dtype == torch.float32


@pytest.mark.parametrize("n", [1, 8, 13, 37, 100])
@pytest.mark.parametrize("k", [32, 96, 576])
def test_conversion_is_exact_both_ways(n, k):
    packed, _ = _q4(n, k)
    qs, d, m = to_blocked(packed.qs, packed.d, packed.m)
    nb = -(-n // 8)
    assert qs.shape == (nb, k // 32, 128) and d.shape == m.shape == (nb, k // 32, 8)
    assert qs.dtype == torch.uint8 and qs.is_contiguous() and d.is_contiguous()
    back = from_blocked(qs, d, m, n)
    for a, b in zip(back, (packed.qs, packed.d, packed.m)):
        assert torch.equal(a, b)
    # Byte 32 j + 4 c + i of block b, group g = rows-layout byte 4 j + i of column 8 b + c.
    b, c, g, j, i = (n - 1) // 8, (n - 1) % 8, k // 32 - 1, 2, 3
    assert qs[b, g, 32 * j + 4 * c + i] == packed.qs[n - 1, 16 * g + 4 * j + i]
    assert d[b, g, c] == packed.d[n - 1, g] and m[b, g, c] == packed.m[n - 1, g]


@pytest.mark.parametrize("n", [1, 8, 16, 37, 100])  # whole and partial blocks, column tiles
@pytest.mark.parametrize("k", [32, 96, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, DENSE_ROWS + 1, 300])
def test_kernel_is_the_tiled_kernels_math(n, k, rows):
    _check_kernel(n, k, rows, "q4_1")


@pytest.mark.parametrize("n", [1, 16, 37])
@pytest.mark.parametrize("rows", [1, 2, 3, 300])  # each of the kernel's row tilings
@pytest.mark.parametrize("fmt", ["q4_0", "rtn"])
def test_kernel_is_the_tiled_kernels_math_for_the_other_scale_formats(n, rows, fmt):
    _check_kernel(n, 96, rows, fmt)


def _check_kernel(n: int, k: int, rows: int, fmt: str) -> None:
    packed, wq = _q4(n, k, seed=n + k, fmt=fmt)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    kern = quant_kernels()
    got = kern.quant_gemm_q4_blocked(x, *to_blocked(packed.qs, packed.d, packed.m), n)
    assert got.shape == (rows, n)
    assert torch.equal(got, kern.quant_gemm_q4_tiled(x, packed.qs, packed.d, packed.m))
    scale = float((x.abs() @ wq.abs().t()).max())
    base = kern.quant_gemm_q4(x, packed.qs, packed.d, packed.m)
    torch.testing.assert_close(got, base, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(got, F.linear(x, wq), rtol=0, atol=2e-2 * scale)  # int8 rounding


@pytest.mark.skipif(not vnni_available(), reason="no AVX-512 VNNI kernels on this CPU")
@pytest.mark.parametrize("n", [1, 13, 37, 100])  # partial and whole tiles of 16 and 32 columns
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, DENSE_ROWS + 1, 300])
@pytest.mark.parametrize("fmt", FORMATS)
def test_vnni_tiles_give_the_same_floats(n, rows, fmt):
    """``vnni=True`` (dpbusd into int32 group sums, wider column tiles) gives the AVX2 tiles'
    outputs bit for bit, in both layouts, for every scale format."""
    packed, _ = _q4(n, 96, seed=n + rows, fmt=fmt)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) * 3
    kern = quant_kernels()
    blocked = to_blocked(packed.qs, packed.d, packed.m)
    want = kern.quant_gemm_q4_blocked(x, *blocked, n)
    assert torch.equal(kern.quant_gemm_q4_blocked(x, *blocked, n, vnni=True), want)
    assert torch.equal(kern.quant_gemm_q4_tiled(x, packed.qs, packed.d, packed.m, vnni=True),
                       want)


def test_tiles_instructions_are_a_setting_of_the_module():
    """``choose(q4_tiles=...)``: ``vnni`` only where built (elsewhere a ValueError, and the kernels
    refuse ``vnni=True``); the outputs do not change with it in either layout."""
    packed, _ = _q4(40, 64)
    lin = QuantLinear(packed)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    assert lin.kernels.q4_tiles == "avx2"
    with pytest.raises(ValueError, match="4-bit tiles"):
        lin.choose(q4_tiles="amx")
    if not vnni_available():
        with pytest.raises(ValueError, match="not built"):
            lin.choose(q4_tiles="vnni")
        with pytest.raises(RuntimeError, match="not built"):
            quant_kernels().quant_gemm_q4_tiled(x, packed.qs, packed.d, packed.m, vnni=True)
        return
    want = lin.tiles(x)
    cat = QuantConcat([lin])
    cat.choose(q4_tiles="vnni")
    assert lin.kernels.q4_tiles == "vnni" and torch.equal(lin.tiles(x), want)
    lin.choose(q4_layout="blocked")
    assert torch.equal(lin.tiles(x), want)


@pytest.mark.skipif(not amx_available(), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("n", [1, 8, 13, 16, 37, 100])  # one block, an odd count, partial tiles
@pytest.mark.parametrize("k", [32, 96, 640])
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, DENSE_ROWS + 1, 300])  # 300: two chunks
@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_tiles_give_the_same_floats(n, k, rows, fmt):
    """``amx=True`` (one TDPBSUD per scale group, the int8 tiles' float epilogue) gives the
    tiles' outputs bit for bit, for every scale format, whole and partial tiles of 16 columns
    and blocks of 16 rows; each row's output is its own (the last row alone gives the same)."""
    packed, _ = _q4(n, k, seed=n + k + rows, fmt=fmt)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    kern = quant_kernels()
    blocked = to_blocked(packed.qs, packed.d, packed.m)
    want = kern.quant_gemm_q4_blocked(x, *blocked, n, vnni=vnni_available())
    got = kern.quant_gemm_q4_blocked(x, *blocked, n, amx=True)
    assert torch.equal(got, want)
    assert torch.equal(kern.quant_gemm_q4_blocked(x[-1:], *blocked, n, amx=True), want[-1:])


class _AmxCalls:
    """The CPU kernels, recording the ``amx`` argument of each ``quant_gemm_q4_blocked``."""

    def __init__(self, kernels) -> None:
        self._k, self.amx = kernels, []

    def __getattr__(self, name):
        return getattr(self._k, name)

    def quant_gemm_q4_blocked(self, *args):
        self.amx.append(args[-1])
        return self._k.quant_gemm_q4_blocked(*args)


def test_amx_tiles_are_a_setting_of_the_module():
    """``choose(q4_amx="on")`` (only where the AMX tiles are available; elsewhere a ValueError and
    the kernel refuses ``amx=True``) sends a blocked weight's inputs from ``q4_amx_from`` rows
    (a prefill; with 16, decode batches of 16 too) to them, with unchanged outputs; the rows
    layout ignores it; a QuantConcat forwards both settings."""
    packed, _ = _q4(40, 64)
    lin = QuantLinear(packed)
    x = torch.randn(DENSE_ROWS + 9, 64, generator=torch.Generator().manual_seed(4))
    assert (lin.kernels.q4_amx, lin.kernels.q4_amx_from, lin.amx_from) == ("off", Q4_AMX_FROM[0], None)
    with pytest.raises(ValueError, match="4-bit AMX tiles"):
        lin.choose(q4_amx="maybe")
    with pytest.raises(ValueError, match="4-bit AMX row threshold"):
        lin.choose(q4_amx_from="4")
    if not amx_available():
        with pytest.raises(ValueError, match="not available"):
            lin.choose(q4_amx="on")
        with pytest.raises(RuntimeError, match="AMX tiles are not available"):
            quant_kernels().quant_gemm_q4_blocked(
                x, *to_blocked(packed.qs, packed.d, packed.m), 40, amx=True)
        return
    lin.set_batch_invariant()  # blocked, every row count on the tiles
    want = {n: lin(x[:n]) for n in (15, 16, DENSE_ROWS + 9)}
    cat = QuantConcat([lin])
    cat.choose(q4_amx="on")
    assert lin.kernels.q4_amx == "on" and lin.amx_from == DENSE_ROWS + 1
    lin._kernels = calls = _AmxCalls(lin._kernels)
    for n in (15, 16, DENSE_ROWS + 9):
        assert torch.equal(lin(x[:n]), want[n])
    assert calls.amx == [False, False, True]
    cat.choose(q4_amx_from="16")
    calls.amx.clear()
    for n in (15, 16, DENSE_ROWS + 9):
        assert torch.equal(lin(x[:n]), want[n])
    assert lin.amx_from == 16 and calls.amx == [False, True, True]
    lin.choose(q4_layout="rows")
    assert lin.amx_from is None


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantised_rows_equal_the_rows_layouts(bf16, fmt):
    packed, _ = _q4(37, 96, fmt=fmt)
    kern = quant_kernels()
    ids = torch.tensor([36, 0, 8, 17, 17])
    want = kern.quant_dequant_q4(packed.qs, packed.d, packed.m, ids, bf16)
    got = kern.quant_dequant_q4_blocked(*to_blocked(packed.qs, packed.d, packed.m), ids, bf16)
    assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="outside the weight"):
        kern.quant_dequant_q4_blocked(*to_blocked(packed.qs, packed.d, packed.m),
                                      torch.tensor([40]), bf16)


def test_kernel_refuses_a_malformed_weight():
    packed, _ = _q4(16, 64)
    qs, d, m = to_blocked(packed.qs, packed.d, packed.m)
    x = torch.randn(2, 64)
    kern = quant_kernels()
    with pytest.raises(RuntimeError, match="cannot hold"):
        kern.quant_gemm_q4_blocked(x, qs, d, m, 17)
    with pytest.raises(RuntimeError, match="x must be"):
        kern.quant_gemm_q4_blocked(torch.randn(2, 32), qs, d, m, 16)
    with pytest.raises(RuntimeError, match="d and m"):
        kern.quant_gemm_q4_blocked(x, qs, d[:, :1].contiguous(), m, 16)


@pytest.mark.parametrize("prefill", ["panels", "int8"])
def test_quant_linear_serves_every_row_count_from_the_blocked_weight(prefill):
    """``choose(q4_layout="blocked")``: decode-sized inputs run the blocked kernel (= the tiles'
    math), larger ones the chosen prefill path (panels dequantised from the blocked weight: the
    same panels), + bias; back to ``rows`` restores the weight exactly. 8-bit ignores it."""
    packed, _ = _q4(100, 576)
    bias = torch.randn(100, generator=torch.Generator().manual_seed(2))
    lin = QuantLinear(packed, bias)
    lin.choose(q4_prefill=prefill)
    x = torch.randn(DENSE_ROWS + 9, 576, generator=torch.Generator().manual_seed(3))
    sizes = (1, 2, 3, 16, DENSE_ROWS, DENSE_ROWS + 9)
    before = {n: lin(x[:n]) for n in sizes}
    rows_qs = lin.qs.clone()
    lin.choose(q4_layout="blocked")
    assert lin.blocked and lin.tiles_from is None and "q4 blocked" in repr(lin)
    kern = quant_kernels()
    for n in sizes:
        if n <= DENSE_ROWS or prefill == "int8":
            want = kern.quant_gemm_q4_tiled(x[:n], packed.qs, packed.d, packed.m) + bias
        else:
            want = before[n]  # the same dequantised panels
        assert torch.equal(lin(x[:n]), want), n
    assert torch.equal(lin.dequantize_rows(torch.tensor([5, 99])),
                       kern.quant_dequant_q4(packed.qs, packed.d, packed.m,
                                             torch.tensor([5, 99]), False))
    lin.choose(q4_layout="rows")
    assert not lin.blocked and torch.equal(lin.qs, rows_qs)
    assert torch.equal(lin(x[:1]), before[1])
    with pytest.raises(ValueError, match="4-bit layout"):
        lin.choose(q4_layout="columns")
    lin8 = QuantLinear(quantise(torch.randn(16, 64), "int8", 32))
    lin8.choose(q4_layout="blocked")
    assert not lin8.blocked


def test_quant_concat_forwards_the_layout():
    a, _ = _q4(24, 64, seed=1)
    b8 = quantise(torch.randn(8, 64, generator=torch.Generator().manual_seed(2)), "int8", 32)
    cat = QuantConcat([QuantLinear(a), QuantLinear(b8)])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    want = torch.cat([quant_kernels().quant_gemm_q4_tiled(x, a.qs, a.d, a.m), cat.parts[1](x)], -1)
    cat.choose(q4_layout="blocked")
    assert cat.parts[0].blocked and not cat.parts[1].blocked
    assert torch.equal(cat(x), want)


def test_a_blocked_tied_head_still_embeds():
    """A 4-bit token table tied to the logits head: the probe may store the head blocked, and
    the embedding's lookups then dequantise the same rows from it."""
    packed, _ = _q4(50, 64, seed=3)
    emb = QuantEmbedding(packed)
    ids = torch.tensor([[0, 49, 7], [8, 8, 23]])
    want = emb(ids)
    emb.head.choose(q4_layout="blocked")
    assert emb.head.blocked and torch.equal(emb(ids), want)
