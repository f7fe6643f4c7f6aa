"""The faithful packed kernels (engine/cpu/csrc/quant_faithful.cpp, issue 65): packed 4-bit and
8-bit weights times float32 or bfloat16 activations agree with PyTorch's dequantise-then-matmul
to float tolerance, at every row count 1..64 and odd shapes, and row r's output does not depend
on the batch it is computed in (bit for bit).

``KVSERVE_CPU_MARCH=haswell`` runs the same tests on the AVX2 build (float32 activations)."""

from __future__ import annotations

import pytest
import torch

from engine.cpu import kernels_faithful as kf
from engine.quantization.formats import PackedQ4, PackedQ8

pytestmark = pytest.mark.skipif(kf.load() is None, reason="faithful kernels unavailable")


def _q4(n: int, k: int, g: torch.Generator, mins: bool = True) -> PackedQ4:
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.05 + 0.001
    m = -torch.rand(n, k // 32, generator=g) * 0.4 if mins else -8 * d  # Q4_1/Q4_K or Q4_0
    return PackedQ4(qs, d, m)


def _q8(n: int, k: int, g: torch.Generator, group: int = 32, mins: bool = False,
        high: int = 128) -> PackedQ8:
    qs = torch.randint(-high, high, (n, k), dtype=torch.int8, generator=g)
    d = torch.rand(n, k // group, generator=g) * 0.01 + 0.0005
    m = -torch.rand(n, k // group, generator=g) * 0.2 if mins else None
    return PackedQ8(qs, d, m)


# (name, maker): the packed forms GGUF's types map onto (gguf_blocks.py)
FORMATS = {
    "q4_0": lambda n, k, g: _q4(n, k, g, mins=False),
    "q4_1/q4_k": lambda n, k, g: _q4(n, k, g),
    "q8_0": lambda n, k, g: _q8(n, k, g),
    "q5_k": lambda n, k, g: _q8(n, k, g, mins=True, high=32),
    "q6_k": lambda n, k, g: _q8(n, k, g, group=16, high=32),
    "q2_k": lambda n, k, g: _q8(n, k, g, group=16, mins=True, high=4),
}
PATHS = [False, True]  # bf16 activations (where built; else float32 again)


def _reference(x: torch.Tensor, w, bf16: bool) -> torch.Tensor:
    """``d * q`` times the activations (bf16-rounded on the bf16 path) plus ``m`` times the
    float32 activations' group sums: the kernel's decomposition, in float64."""
    xr = x.to(torch.bfloat16).float() if bf16 and kf.bf16_available() else x
    if w.m is None:
        return (xr.double() @ w.dequantize().double().T).float()
    n, k = w.shape
    s = k // w.m.shape[1]
    mins = w.m.double().repeat_interleave(s, dim=1)
    return (xr.double() @ (w.dequantize().double() - mins).T + x.double() @ mins.T).float()


def _run(x: torch.Tensor, w, bf16: bool) -> torch.Tensor:
    return kf.gemm(x, w.qs, w.d, w.m, bf16=bf16)


def _close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w) -> None:
    # float32 accumulation of K products: relative to the sum of |products|
    scale = (x.abs().double() @ w.dequantize().abs().double().T).float()
    err = (got - want).abs()
    assert bool((err <= 1e-5 * scale + 1e-6).all()), float((err / (scale + 1e-9)).max())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bf16", PATHS)
def test_matches_dequantise_then_matmul_at_every_row_count(fmt, bf16):
    g = torch.Generator().manual_seed(0)
    w = FORMATS[fmt](40, 96, g)
    x = torch.randn(64, 96, generator=g)
    full = _run(x, w, bf16)
    _close(full, _reference(x, w, bf16), x, w)
    for rows in range(1, 65):
        got = _run(x[:rows], w, bf16)
        assert torch.equal(got, full[:rows]), rows  # batch-invariant: bit for bit


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1/q4_k", "q8_0", "q6_k", "q2_k"])
@pytest.mark.parametrize("bf16", PATHS)
def test_float16_scales_give_the_float32_scales_bits(fmt, bf16):
    """A GGUF's float16 scales, kept at their size (``compact_scales``), multiply exactly as
    their float32 copies do: the same bits, at decode and prefill row counts."""
    g = torch.Generator().manual_seed(11)
    w = FORMATS[fmt](70, 192, g)
    d16 = w.d.half()
    m16 = None if w.m is None else w.m.half()
    d32, m32 = d16.float(), None if m16 is None else m16.float()
    assert kf.compact_scales(d32, m32)[0].dtype == torch.float16
    for rows in (1, 3, 4, 5, 9, 40):
        x = torch.randn(rows, 192, generator=g)
        assert torch.equal(kf.gemm(x, w.qs, d16, m16, bf16=bf16),
                           kf.gemm(x, w.qs, d32, m32, bf16=bf16)), rows


def test_scales_that_float16_cannot_hold_stay_float32():
    d = torch.tensor([[0.1, 1e-9]])
    assert kf.compact_scales(d, None)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="one dtype"):
        kf.scale_flags(d.half(), d)


@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 64), (33, 160), (100, 576), (257, 1536)])
@pytest.mark.parametrize("fmt", ["q4_1/q4_k", "q8_0", "q6_k"])
@pytest.mark.parametrize("bf16", PATHS)
def test_odd_shapes(n, k, fmt, bf16):
    g = torch.Generator().manual_seed(n + k)
    w = FORMATS[fmt](n, k, g)
    for rows in (1, 3, 5, 17):
        x = torch.randn(rows, k, generator=g) * 3
        _close(_run(x, w, bf16), _reference(x, w, bf16), x, w)


@pytest.mark.parametrize("bf16", PATHS)
def test_a_rows_output_does_not_depend_on_its_batch(bf16):
    """Row r alone, in a batch of other rows, at any position: the same bits."""
    g = torch.Generator().manual_seed(5)
    w = FORMATS["q4_1/q4_k"](300, 576, g)  # big enough to run threaded
    x = torch.randn(37, 576, generator=g)
    alone = torch.cat([_run(x[r:r + 1], w, bf16) for r in range(37)])
    assert torch.equal(_run(x, w, bf16), alone)
    perm = torch.randperm(37, generator=g)
    assert torch.equal(_run(x[perm], w, bf16), alone[perm])


def test_bf16_activations_are_closer_to_float_than_int8_groups():
    """The point of the path: with an outlier in a group, int8 per-group rounding (amax/127)
    loses the small activations; bf16 keeps each element's own exponent."""
    from engine.quantization.linear import quant_kernels

    k = quant_kernels()
    if k is None:
        pytest.skip("main CPU kernels unavailable")
    g = torch.Generator().manual_seed(9)
    w = FORMATS["q4_1/q4_k"](64, 256, g)
    x = torch.randn(4, 256, generator=g) * 0.05
    x[:, ::32] = 20.0  # one outlier per group
    exact = (x.double() @ w.dequantize().double().T)
    faithful = (_run(x, w, True).double() - exact).abs().max()
    int8 = (k.quant_gemm_q4(x, w.qs, w.d, w.m).double() - exact).abs().max()
    assert faithful * 10 < int8


def test_quant_linear_on_the_faithful_path_is_batch_invariant():
    """``QuantLinear.choose(activation="bf16")`` serves every row count with the faithful kernel
    in batch-invariant mode (the rows layout kept), and the gathered columns agree bit for
    bit (a logits head under a grammar)."""
    from engine.quantization.linear import QuantLinear, quant_kernels

    if quant_kernels() is None:
        pytest.skip("main CPU kernels unavailable")
    g = torch.Generator().manual_seed(2)
    mod = QuantLinear(FORMATS["q4_1/q4_k"](96, 128, g))
    mod.choose(activation="bf16")
    assert mod.faithful
    mod.set_batch_invariant()
    assert not mod.blocked
    x = torch.randn(50, 128, generator=g)
    full = mod(x)
    assert torch.equal(full, _run(x, FORMATS["q4_1/q4_k"](96, 128, torch.Generator()
                                                          .manual_seed(2)), True))
    for rows in (1, 2, 7, 33, 50):  # decode sizes and a prefill: one kernel
        assert torch.equal(mod(x[:rows]), full[:rows])
    cols = torch.tensor([3, 90, 17])
    assert torch.equal(mod.forward_columns(x[:5], cols), full[:5, cols])


def test_activation_precision_is_validated_and_chosen():
    from engine.config.engine import EngineConfig
    from engine.quantization.activation import choose

    with pytest.raises(ValueError, match="activation_precision"):
        EngineConfig(activation_precision="fp8")
    assert choose("int8")[0] == "int8"
    # auto's documented default: the faithful float32 kernel where it is the AVX-512 one
    # (within the margin of int8's decode there), int8 elsewhere (activation.py)
    want = "float32" if kf.float32_isa() == "avx512" else "int8"
    assert choose("auto")[0] == want and "faithful" in choose("auto")[1]
    assert choose("float32")[0] == "float32" and choose("bf16")[0] == "bf16"
    assert choose("auto", "int4")[0] == "int8"
