"""The block types of llama.cpp's common mixes beyond Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K
(engine/quantization/gguf_blocks.py): Q5_0 and Q5_1 on the 5-bit form (engine/quantization/formats.py
PackedQ5, engine/cpu/csrc/quant_gemm_q5.cpp), Q2_K, Q3_K, IQ4_NL and IQ4_XS on the 8-bit form
(Q2_K with a scale and a min per 16: both 8-bit kernels' half-group sums).

Truths: ``gguf.quants`` (its quantiser for Q5_0/Q5_1; for the others, which it cannot quantise,
random valid blocks) and its dequantiser, which every packed form must reproduce bit for bit;
for the 5-bit kernel, dequantise-then-``F.linear`` in float64 with the kernel's one
approximation (each activation row rounded to int8 per group of 32) modelled, on ragged shapes
from 1 to 300 rows, and the row-independence of its results (a row's output whatever M).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from engine.loading.packed_policy import is_packable  # noqa: E402
from engine.quantization.formats import PackedQ5, PackedQ8, cat, same_layout  # noqa: E402
from engine.quantization.gguf_blocks import SUPPORTED, from_gguf_blocks  # noqa: E402
from engine.quantization.linear import DENSE_ROWS, QuantLinear, quant_kernels  # noqa: E402

Q5_TYPES = [T.Q5_0, T.Q5_1]
WIDE_TYPES = [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS]  # widened to 8 bits
# The fp16 scales in each block (d; Q2_K: d and dmin)
SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}
SHAPES = {T.Q5_0: [(1, 32), (7, 96), (100, 576)], T.Q5_1: [(3, 64), (49, 160)],
          T.Q2_K: [(1, 256), (11, 768)], T.Q3_K: [(1, 256), (9, 512)],
          T.IQ4_NL: [(5, 96), (17, 576)], T.IQ4_XS: [(1, 256), (7, 768)]}
CASES = [(t, s) for t, shapes in SHAPES.items() for s in shapes]
kernels_built = pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")


def _id(case) -> str:
    return f"{case[0].name}-{case[1][0]}x{case[1][1]}"


def _raw(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of an ``[n, k]`` tensor: gguf's own quantisation of a random weight where
    gguf has a quantiser (Q5_0/Q5_1), else random bytes (every bit pattern of the quants and
    sub-block scales is valid) with finite fp16 scales of both signs."""
    rng = np.random.default_rng(seed)
    if qtype in Q5_TYPES:
        w = rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))
        return quants.quantize(w.astype(np.float32), qtype)
    per, nbytes = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        mag = rng.uniform(1e-3, 5e-2, (n, k // per)) * rng.choice([-1.0, 1.0], (n, k // per))
        raw[..., off:off + 2] = mag.astype(np.float16).view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def _packed(qtype, n: int, k: int, seed: int = 0):
    raw = _raw(qtype, n, k, seed)
    return from_gguf_blocks(raw, int(qtype), (n, k)), torch.from_numpy(quants.dequantize(raw, qtype))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_packed_values_equal_gguf_bit_for_bit(case):
    qtype, (n, k) = case
    packed, ref = _packed(qtype, n, k)
    assert isinstance(packed, PackedQ5 if qtype in Q5_TYPES else PackedQ8)
    assert torch.equal(packed.dequantize(), ref)
    if quant_kernels() is None:
        return
    rows = torch.tensor([n - 1, 0, n // 2])
    got = QuantLinear(packed).dequantize_rows(rows)  # the C++ rows (embedding, prefill panels)
    if qtype in (T.Q5_1, T.Q2_K):  # d * q + m: exact product, one rounding (fused or not)
        torch.testing.assert_close(got, ref[rows], rtol=0, atol=1e-6 * float(ref.abs().max()))
    else:
        assert torch.equal(got, ref[rows])
    got16 = QuantLinear(packed).dequantize_rows(rows, torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, got.bfloat16())


def test_five_bit_form_is_compact_and_moves_whole_groups():
    a, ra = _packed(T.Q5_1, 6, 576, seed=1)
    b, rb = _packed(T.Q5_0, 3, 576, seed=2)
    raw_bytes = 6 * 576 // 32 * 24
    assert a.qs.shape == (6, 576 // 32 * 20) and a.nbytes <= 1.2 * raw_bytes  # 7 vs 6 bits
    assert same_layout([a, b])  # Q5_0 is Q5_1 with m = -16 d: one layout, concatenable
    torch.testing.assert_close(cat([a, b]).dequantize(), torch.cat([ra, rb]), rtol=0, atol=0)
    rows = torch.tensor([5, 0, 2])
    assert torch.equal(a.take_rows(rows).dequantize(), ra[rows])
    with pytest.raises(ValueError, match="20-byte|groups"):
        PackedQ5(a.qs[:, :30], a.d, a.m)
    with pytest.raises(ValueError):
        cat([a, _packed(T.IQ4_NL, 3, 576)[0]])


def test_every_new_type_is_served_packed():
    for qtype in (*Q5_TYPES, *WIDE_TYPES):
        assert int(qtype) in SUPPORTED

    class _Tensor:  # a gguf.GGUFReader tensor's fields that the policy reads
        name, shape, tensor_type = "blk.0.attn_q.weight", (576, 576), T.Q5_0

    assert is_packable(_Tensor())
    _Tensor.tensor_type = T.IQ2_XS  # no exact packed form: dequantised to float
    assert not is_packable(_Tensor())


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ w.T`` with x rounded as the kernel rounds it (int8 per 32, amax/127)."""
    m, k = x.shape
    xg = x.view(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = (torch.round(xg * inv).double() * (amax.double() / 127.0)).view(m, k)
    return xq @ w.double().t()


@kernels_built
@pytest.mark.parametrize("qtype,shape", [(T.Q5_0, (100, 576)), (T.Q5_1, (49, 160)),
                                         (T.Q5_0, (1, 32))], ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, DENSE_ROWS, DENSE_ROWS + 1, 300])
def test_q5_kernel_matches_dequantise_then_linear(qtype, shape, rows):
    packed, w = _packed(qtype, *shape)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(shape[0]))
    lin = QuantLinear(packed, bias)
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    x = torch.randn(rows, shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    got = lin(x.view(1, rows, shape[1])).view(rows, shape[0]).double()
    scale = float((x.abs() @ w.abs().t()).max())
    if rows > lin.dense_rows:  # dequantised panels: plain float32 F.linear
        exact = F.linear(x, lin.dequantize_rows(torch.arange(shape[0])), bias)
        torch.testing.assert_close(got, exact.double(), rtol=0, atol=1e-5 * scale)
        return
    # One near-tie of x/dx rounded the other way per output at most: max|w| * max dx.
    step = float(w.abs().max()) * float(x.abs().max()) / 127
    torch.testing.assert_close(got, _reference(x, w) + bias.double(), rtol=0,
                               atol=1e-5 * scale + step)


@kernels_built
def test_q5_kernel_rows_do_not_depend_on_the_batch():
    packed, _ = _packed(T.Q5_1, 40, 576, seed=3)
    k = quant_kernels()
    x = torch.randn(DENSE_ROWS, 576, generator=torch.Generator().manual_seed(9))
    full = k.quant_gemm_q5(x, packed.qs, packed.d, packed.m)
    for m in (1, 3, 6):
        assert torch.equal(k.quant_gemm_q5(x[:m], packed.qs, packed.d, packed.m), full[:m])
    assert torch.equal(k.quant_gemm_q5(x[5:6], packed.qs, packed.d, packed.m), full[5:6])


@kernels_built
@pytest.mark.parametrize("kernel", ["base", "vnni"])
@pytest.mark.parametrize("shape", [(11, 768), (1, 256)], ids=lambda v: f"{v[0]}x{v[1]}")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 300])
def test_q2k_kernels_match_dequantise_then_linear(kernel, shape, rows):
    """Q2_K's scale and min per 16 in both 8-bit kernels (the mins through the activations'
    half-group sums), against float64 over the dequantised weight with the kernels' int8
    rounding of x modelled; each row's result independent of the batch."""
    from engine.quantization.linear import vnni_available

    if kernel == "vnni" and not vnni_available():
        pytest.skip("no AVX-512 VNNI kernels on this CPU")
    k = quant_kernels()
    gemm = k.quant_gemm_q8 if kernel == "base" else k.quant_gemm_q8_vnni
    packed, w = _packed(T.Q2_K, *shape, seed=rows)
    assert packed.scale_group == 16 and packed.m is not None
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    got = gemm(x, packed.qs, packed.d, packed.m).double()
    scale = float((x.abs() @ w.abs().t()).max())
    step = float(w.abs().max()) * float(x.abs().max()) / 127
    torch.testing.assert_close(got, _reference(x, w), rtol=0, atol=1e-5 * scale + step)
    assert torch.equal(gemm(x[-1:], packed.qs, packed.d, packed.m), got[-1:].float())
