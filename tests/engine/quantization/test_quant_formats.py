"""Packed 4-bit / 8-bit weight formats (engine/quantization/formats.py), the GGUF block types
mapped onto them (engine/quantization/gguf_blocks.py: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) and their
kernels.

Truths: ``gguf.quants`` (GGUF's own quantiser and dequantiser; for the K-quants, which it cannot
quantise, random valid blocks and its dequantiser) for the formats, and for the
kernels a float64 reference that models their one approximation exactly: each activation row
is rounded to int8 per group of 32 (``dx = amax/127``, ``qx = round(x/dx)``, half to even), then
``y = sum_g (d_g*q_g + m_g) . (dx_g*qx_g)``. Against that reference only float32 summation
order differs (relative 1e-5 of the output scale). Against plain float ``F.linear`` the error is
the activation rounding, at most ``dx/2`` per element; that bound is asserted too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from engine.loading.gguf_quant import hf_name, unpermute_rows  # noqa: E402
from engine.quantization.formats import PackedQ4, PackedQ8, cat  # noqa: E402
from engine.quantization.gguf_blocks import from_gguf_blocks  # noqa: E402
from engine.quantization.linear import (  # noqa: E402
    BATCH_TILE_ROWS,
    DENSE_ROWS,
    QuantEmbedding,
    QuantLinear,
    quant_kernels,
)

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0]
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]  # super-blocks of 256: gguf has no quantiser for them
SHAPES = [(1, 32), (7, 96), (33, 64), (100, 576), (49, 160)]  # ragged N, K multiple of 32
K_SHAPES = [(1, 256), (7, 512), (33, 768), (17, 1536)]  # ragged N, K multiple of 256
CASES = [(t, s) for t in TYPES for s in SHAPES] + [(t, s) for t in K_TYPES for s in K_SHAPES]
LINEAR_CASES = ([(t, s) for t in TYPES for s in [(7, 96), (100, 576), (49, 160)]]
                + [(t, s) for t in K_TYPES for s in [(7, 512), (49, 768)]])
Q8_CASES = [c for c in LINEAR_CASES if c[0] in (T.Q8_0, T.Q5_K, T.Q6_K)]  # packed as 8-bit


def _case_id(case) -> str:
    return f"{case[0].name}-{case[1][0]}x{case[1][1]}"


def random_blocks(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid raw blocks of ``qtype`` for an ``[n, k]`` tensor: random bytes everywhere (every bit
    pattern of the quants and of the 6-/8-bit sub-block scales is valid) except the fp16 super-
    block scales, drawn finite, of both signs and of varied magnitude per row."""
    rng = np.random.default_rng(seed)
    per, nbytes = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    offsets = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
    for off in offsets:
        mag = rng.uniform(1e-3, 5e-2, (n, k // per)) * rng.uniform(0.1, 3.0, (n, 1))
        v = (mag * rng.choice([-1.0, 1.0], mag.shape)).astype(np.float16)
        raw[..., off:off + 2] = v.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def _packed(n: int, k: int, qtype, seed: int = 0):
    if qtype in K_TYPES:
        raw = random_blocks(qtype, n, k, seed)
    else:
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
        raw = quants.quantize(w, qtype)
    return from_gguf_blocks(raw, int(qtype), (n, k)), torch.from_numpy(quants.dequantize(raw, qtype))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dequantize_equals_gguf(case):
    qtype, shape = case
    packed, ref = _packed(*shape, qtype)
    torch.testing.assert_close(packed.dequantize(), ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    if quant_kernels() is not None:  # the C++ row dequantiser (embedding lookups, prefill)
        rows = torch.tensor([shape[0] - 1, 0, shape[0] // 2])
        got = QuantLinear(packed).dequantize_rows(rows)
        torch.testing.assert_close(got, ref[rows], rtol=0, atol=1e-6 * float(ref.abs().max()))
        # bfloat16 panels (prefill's bf16 matmul): the float rows rounded to nearest even.
        got16 = QuantLinear(packed).dequantize_rows(rows, torch.bfloat16)
        assert got16.dtype == torch.bfloat16 and torch.equal(got16, got.bfloat16())


def test_q4_0_is_exact_and_layouts():
    packed, ref = _packed(5, 64, T.Q4_0)
    assert isinstance(packed, PackedQ4) and packed.qs.dtype == torch.uint8
    assert packed.qs.shape == (5, 32) and packed.d.shape == (5, 2) and packed.d.dtype == torch.float32
    assert torch.equal(packed.dequantize(), ref)  # m = -8 d: exact in float32
    q8, _ = _packed(5, 64, T.Q8_0)
    assert q8.qs.dtype == torch.int8 and q8.qs.shape == (5, 64)


def test_rows_and_concatenation_move_whole_groups():
    a, ra = _packed(6, 64, T.Q4_1, seed=1)
    b, rb = _packed(3, 64, T.Q4_1, seed=2)
    torch.testing.assert_close(cat([a, b]).dequantize(), torch.cat([ra, rb]))
    rows = torch.tensor([5, 0, 2])
    torch.testing.assert_close(a.take_rows(rows).dequantize(), ra[rows])
    q8, _ = _packed(3, 64, T.Q8_0)
    with pytest.raises(ValueError):
        cat([a, q8])


def test_k_quants_map_exactly_onto_the_packed_forms():
    q4k, r4 = _packed(3, 512, T.Q4_K, seed=3)
    assert isinstance(q4k, PackedQ4) and q4k.d.shape == (3, 16)  # one (d, m) per sub-block
    q5k, r5 = _packed(3, 512, T.Q5_K, seed=4)
    assert isinstance(q5k, PackedQ8) and q5k.scale_group == 32 and q5k.m is not None
    assert int(q5k.qs.min()) >= 0 and int(q5k.qs.max()) <= 31
    q6k, r6 = _packed(3, 512, T.Q6_K, seed=5)
    assert isinstance(q6k, PackedQ8) and q6k.scale_group == 16 and q6k.m is None
    assert int(q6k.qs.min()) >= -32 and int(q6k.qs.max()) <= 31
    for packed, ref in ((q4k, r4), (q5k, r5), (q6k, r6)):  # same two roundings as gguf's
        assert torch.equal(packed.dequantize(), ref)
    rows = torch.tensor([2, 0])
    torch.testing.assert_close(cat([q6k, q6k.take_rows(rows)]).dequantize(),
                               torch.cat([r6, r6[rows]]), rtol=0, atol=0)
    for other in (q5k, _packed(3, 512, T.Q8_0)[0]):  # scale group or mins differ
        with pytest.raises(ValueError):
            cat([q6k, other])
    with pytest.raises(ValueError):  # one min per scale group, shaped like the scales
        PackedQ8(q6k.qs, q6k.d, torch.zeros(3, 512 // 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        from_gguf_blocks(random_blocks(T.Q4_K, 1, 256)[:, :72], int(T.Q4_K), (1, 128))


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_the_tests_k_quant_encoder_writes_what_gguf_reads(qtype):
    """tests/support/kquant_encode.py (the K-quant GGUFs of the engine tests) against gguf's
    dequantiser: round-to-nearest within its type's resolution, and our decoder agrees."""
    from tests.support.kquant_encode import ENCODERS

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 2.0, (6, 1))).astype(np.float32)
    raw = ENCODERS[qtype.name](w)
    assert raw.shape == (6, 2 * quants.GGML_QUANT_SIZES[qtype][1])
    ref = quants.dequantize(raw, qtype)
    rel = np.sqrt(((ref - w) ** 2).mean() / (w**2).mean())
    assert rel < {T.Q4_K: 0.1, T.Q5_K: 0.05, T.Q6_K: 0.025}[qtype]
    assert torch.equal(from_gguf_blocks(raw, int(qtype), w.shape).dequantize(),
                       torch.from_numpy(ref))


def test_unpermute_undoes_llama_cpp_permutation():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    hf = np.arange(48 * 3).reshape(48, 3)
    gguf_rows = permute(hf, 4)
    assert np.array_equal(gguf_rows[unpermute_rows(48, 4).numpy()], hf)
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.3.attn_norm.weight") is None


def _reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y with the kernel's activation rounding modelled, float64; per-row error bound vs
    plain float: sum over k of |w| * dx/2)."""
    m, k = x.shape
    xg = x.view(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # float32, as the kernel
    qx = torch.round(xg * inv)
    xq = (qx.double() * (amax.double() / 127.0)).view(m, k)
    y = xq @ w.double().t()
    bound = (w.double().abs().view(w.shape[0], k // 32, 32).sum(-1)
             @ (amax.double().view(m, k // 32) / 127.0 / 2).t()).t()
    return y, bound


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("case", LINEAR_CASES, ids=_case_id)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, DENSE_ROWS, DENSE_ROWS + 1, 300])
def test_quant_linear_matches_reference(case, rows):
    qtype, shape = case
    packed, w = _packed(*shape, qtype)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(shape[0]))
    lin = QuantLinear(packed, bias)
    gen = torch.Generator().manual_seed(rows * 1000 + shape[0])
    x = torch.randn(rows, shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    got = lin(x.view(1, rows, shape[1])).view(rows, shape[0])
    scale = float((x.abs() @ w.abs().t()).max())
    exact = F.linear(x.double(), w.double(), bias.double())
    if rows > lin.dense_rows:  # dequantise-then-matmul: plain float32 math
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-5 * scale)
        return
    ref, bound = _reference(x, w)
    # Rarely (~1 activation element in 10^6 on random data, seen 3 times in 400 seeds of
    # 16 x 576) the kernel and this reference round a near-tie x/dx to neighbouring integers;
    # allow one such step per output: max|w| * max dx.
    step = float(w.abs().max()) * float(x.abs().max()) / 127
    torch.testing.assert_close(got.double(), ref + bias.double(), rtol=0,
                               atol=1e-5 * scale + step)
    assert bool(((got.double() - exact).abs() <= bound + 1e-5 * scale).all())


def _vnni_built() -> bool:
    return quant_kernels() is not None and bool(quant_kernels().quant_gemm_q4_vnni_available())


@pytest.mark.skipif(not _vnni_built(), reason="AVX-512 VNNI kernel not built on this CPU")
@pytest.mark.parametrize("k", [32, 64, 96, 576, 1536])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, DENSE_ROWS])
def test_vnni_q4_kernel_equals_the_base_kernel(k, rows):
    """The AVX-512 VNNI 4-bit kernel does the base kernel's integer math two groups at a time
    (its own activation layout; an odd last group): equal up to float summation order, for
    even and odd group counts and every row tile."""
    w = torch.randn(37, k, generator=torch.Generator().manual_seed(k)) * 0.05
    rng = np.random.default_rng(k)
    raw = quants.quantize(w.numpy(), T.Q4_1)
    lin = QuantLinear(from_gguf_blocks(raw, int(T.Q4_1), (37, k)))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * float(rng.uniform(0.5, 4))
    base = lin(x)
    lin.choose(q4_kernel="vnni")
    got = lin(x)
    scale = float((x.abs() @ torch.from_numpy(quants.dequantize(raw, T.Q4_1)).abs().t()).max())
    torch.testing.assert_close(got, base, rtol=0, atol=1e-5 * scale)
    with pytest.raises(ValueError, match="decode kernel"):
        lin.choose(q4_kernel="avx9")


@pytest.mark.skipif(not _vnni_built(), reason="AVX-512 VNNI kernels not built on this CPU")
@pytest.mark.parametrize("case", Q8_CASES, ids=_case_id)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, DENSE_ROWS])
def test_vnni_q8_kernel_equals_the_base_kernel(case, rows):
    """The AVX-512 VNNI 8-bit kernel does the base kernel's integer math 64 weights at a time,
    for every 8-bit layout (a scale per 32: Q8_0; per 16: Q6_K; with mins: Q5_K), even and odd
    group counts and every row tile: equal up to float summation order."""
    qtype, shape = case
    packed, w = _packed(*shape, qtype)
    lin = QuantLinear(packed, torch.randn(shape[0], generator=torch.Generator().manual_seed(1)))
    assert not lin.is_q4
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)) * 2
    base = lin(x)
    lin.choose(q8_kernel="vnni")
    got = lin(x)
    scale = float((x.abs() @ w.abs().t()).max())
    torch.testing.assert_close(got, base, rtol=0, atol=1e-5 * scale)


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("n", [1, 8, 16, 37, 100])  # whole and partial 8-column blocks, tiles
@pytest.mark.parametrize("k", [32, 96, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, DENSE_ROWS + 1, 300])
def test_q4_tiled_kernel_equals_the_base_kernel(n, k, rows):
    """The prefill-sized 4-bit kernel does the decode kernel's integer math (int8-rounded
    activations, per group d*dx*sum(q*qx) + m*sx) in another order: equal to it up to float
    summation order, and to the reference model of that math, for ragged column counts
    (partial blocks and tiles) and every row tile."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01  # Q4_1: mins are not zero
    raw = quants.quantize(w.numpy(), T.Q4_1)
    packed = from_gguf_blocks(raw, int(T.Q4_1), (n, k))
    wq = torch.from_numpy(quants.dequantize(raw, T.Q4_1)).float()
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
    kern = quant_kernels()
    got = kern.quant_gemm_q4_tiled(x, packed.qs, packed.d, packed.m)
    base = kern.quant_gemm_q4(x, packed.qs, packed.d, packed.m)
    scale = float((x.abs() @ wq.abs().t()).max())
    torch.testing.assert_close(got, base, rtol=0, atol=1e-5 * scale)
    ref, _ = _reference(x, wq)
    step = float(wq.abs().max()) * float(x.abs().max()) / 127  # a near-tie rounded the other way
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5 * scale + step)


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("case", LINEAR_CASES, ids=_case_id)
def test_int8_prefill_takes_the_tiled_kernel_above_the_decode_rows(case):
    """``choose(q4_prefill="int8")``: a 4-bit weight's inputs above ``dense_rows`` run the tiled
    kernel (+ bias), smaller ones are unchanged; 8-bit weights keep their panels."""
    qtype, shape = case
    packed, w = _packed(*shape, qtype)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(5))
    lin = QuantLinear(packed, bias)
    x = torch.randn(DENSE_ROWS + 9, shape[1], generator=torch.Generator().manual_seed(4))
    small, panels = lin(x[:5]), lin(x)
    lin.choose(q4_prefill="int8")
    if lin.is_q4:
        want = quant_kernels().quant_gemm_q4_tiled(x, lin.qs, lin.d, lin.m) + bias
        assert torch.equal(lin(x), want)
    else:
        assert torch.equal(lin(x), panels)
    assert torch.equal(lin(x[:5]), small)
    with pytest.raises(ValueError, match="4-bit prefill"):
        lin.choose(q4_prefill="fp8")


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("case", LINEAR_CASES, ids=_case_id)
def test_batch_tiles_serve_decode_batches_from_their_row_count(case):
    """``choose(q4_batch="tiles")``: a 4-bit weight's inputs of ``BATCH_TILE_ROWS`` to
    ``dense_rows`` rows run the tiled kernel, fewer rows the decode kernel, more the dense path
    (unchanged); 8-bit weights ignore it."""
    qtype, shape = case
    packed, _ = _packed(*shape, qtype)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(6))
    lin = QuantLinear(packed, bias)
    x = torch.randn(DENSE_ROWS + 9, shape[1], generator=torch.Generator().manual_seed(8))
    sizes = (1, BATCH_TILE_ROWS - 1, BATCH_TILE_ROWS, 16, DENSE_ROWS, DENSE_ROWS + 9)
    before = {n: lin(x[:n]) for n in sizes}
    lin.choose(q4_batch="tiles")
    assert lin.tiles_from == (BATCH_TILE_ROWS if lin.is_q4 else None)
    for n in sizes:
        if lin.is_q4 and BATCH_TILE_ROWS <= n <= DENSE_ROWS:
            want = quant_kernels().quant_gemm_q4_tiled(x[:n], lin.qs, lin.d, lin.m) + bias
        else:
            want = before[n]
        assert torch.equal(lin(x[:n]), want), n
    with pytest.raises(ValueError, match="4-bit batch"):
        lin.choose(q4_batch="gpu")


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("case", LINEAR_CASES, ids=_case_id)
def test_bf16_panels_are_a_bf16_matmul_of_the_dequantised_weight(case):
    """With bfloat16 panels (chosen by the start-up probe where faster) the dense path is
    exactly ``F.linear`` of bf16-rounded activations and weights, float32 out (+ bias); the
    decode-sized kernel path is unchanged."""
    qtype, shape = case
    packed, w = _packed(*shape, qtype)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(7))
    lin = QuantLinear(packed, bias)
    x = torch.randn(DENSE_ROWS + 7, shape[1], generator=torch.Generator().manual_seed(3))
    small = lin(x[:3])
    lin.choose(panel_dtype=torch.bfloat16)
    w16 = lin.dequantize_rows(torch.arange(shape[0]), torch.bfloat16)
    want = F.linear(x.bfloat16(), w16).float() + bias
    torch.testing.assert_close(lin(x), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert torch.equal(lin(x[:3]), small)
    scale = float((x.abs() @ w.abs().t()).max())
    assert float((lin(x) - F.linear(x, w, bias)).abs().max()) < 2e-2 * scale  # bf16 rounding
    with pytest.raises(ValueError, match="panel dtype"):
        lin.choose(panel_dtype=torch.float16)


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize(("qtype", "k"), [(T.Q8_0, 64), (T.Q6_K, 256), (T.Q4_K, 256)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_quant_embedding_lookup_and_tied_head(qtype, k):
    packed, w = _packed(50, k, qtype)
    emb = QuantEmbedding(packed)
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    torch.testing.assert_close(emb(ids), w[ids], rtol=0, atol=1e-6 * float(w.abs().max()))
    assert emb.head.out_features == 50 and emb.head(torch.randn(2, k)).shape == (2, 50)


@pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_q4_float_fma_variant_is_plain_float_math(rows):
    packed, w = _packed(49, 160, T.Q4_1)
    x = torch.randn(rows, 160)
    got = quant_kernels().quant_gemm_q4_fma(x, packed.qs, packed.d, packed.m)
    scale = float((x.abs() @ w.abs().t()).max())
    torch.testing.assert_close(got, F.linear(x, w), rtol=0, atol=1e-5 * scale)
