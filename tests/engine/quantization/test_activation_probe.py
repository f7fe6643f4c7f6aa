"""``--activation-precision auto``'s measurement (engine/quantization/activation_probe.py): the
rule never lets noise push a packed model off the faithful kernel when its true speed is within
the margin, the measurement leaves the weights exactly restorable, and the documented default
holds where nothing is measured."""

from __future__ import annotations

import random

import pytest
import torch

from engine.cpu import kernels_faithful as kf
from engine.quantization.activation import MARGIN, apply_activation_precision, choose
from engine.quantization.activation_probe import (
    ActivationMeasure,
    confirmed,
    decide,
    measure,
    sampled_parts,
)
from engine.quantization.formats import PackedQ4, PackedQ8
from engine.quantization.linear import QuantLinear, quant_kernels
from engine.weight_prep.activation_measure import stack_passes


def test_the_rule_decides_only_on_separated_runs():
    assert decide(ActivationMeasure((1.10, 1.12, 1.11, 1.13), (1.0, 1.01, 1.02, 1.0)),
                  MARGIN) == "float32"
    assert decide(ActivationMeasure((1.6, 1.62, 1.61, 1.7), (1.0, 1.01, 1.02, 1.0)),
                  MARGIN) == "int8"
    # one side's runs straddle the margin: no verdict (the documented default holds)
    assert decide(ActivationMeasure((1.1, 1.4, 1.2, 1.35), (1.0, 1.01, 1.02, 1.0)),
                  MARGIN) is None
    # a stalled run is the slowest quarter: dropped
    assert decide(ActivationMeasure((1.1, 1.1, 1.1, 9.0), (1.0, 1.0, 1.0, 1.0)),
                  MARGIN) == "float32"


@pytest.mark.parametrize("seed", range(200))
def test_noise_never_takes_a_within_margin_kernel_to_int8(seed):
    """True speeds within the margin (faithful 0.8-1.2x int8), each run inflated by a busy
    machine (0-30%) and now and then stalled (2-10x): the verdict is float32 or none, never
    int8; and a kernel truly 2x slower is never kept."""
    rng = random.Random(seed)
    base = rng.uniform(1e-3, 1e-2)

    def runs(true: float) -> tuple[float, ...]:
        return tuple(true * (1 + rng.uniform(0, 0.3)) * (rng.uniform(2, 10)
                                                         if rng.random() < 0.15 else 1)
                     for _ in range(4))

    close = ActivationMeasure(runs(base * rng.uniform(0.8, 1.2)), runs(base))
    assert decide(close, MARGIN) != "int8"
    far = ActivationMeasure(runs(base * 2.0), runs(base))
    assert decide(far, MARGIN) != "float32"


def _modules(g: torch.Generator) -> list[QuantLinear]:
    qs = torch.randint(0, 256, (96, 64), dtype=torch.uint8, generator=g)
    d = (torch.rand(96, 4, generator=g) * 0.05 + 0.001).half().float()
    m = (-torch.rand(96, 4, generator=g) * 0.4).half().float()
    q8 = PackedQ8(torch.randint(-128, 127, (40, 128), dtype=torch.int8, generator=g),
                  (torch.rand(40, 4, generator=g) * 0.01).half().float(), None)
    return [QuantLinear(PackedQ4(qs, d, m)), QuantLinear(q8)]


@pytest.mark.skipif(kf.load() is None or quant_kernels() is None,
                    reason="CPU kernels unavailable")
def test_measuring_leaves_the_weights_exactly_restorable():
    g = torch.Generator().manual_seed(3)
    mods = _modules(g)
    x = {m.in_features: torch.randn(5, m.in_features, generator=g) for m in mods}
    for m in mods:
        m.set_batch_invariant()
    before = [m.kernels for m in mods]
    int8_out = [m(x[m.in_features]) for m in mods]
    parts = sampled_parts(mods)
    assert parts == mods
    got = measure(parts, invariant=True, time_passes=stack_passes)
    assert len(got.faithful_runs) == len(got.int8_runs) >= 4 and got.ratio > 0
    assert all(m.faithful and m.d.dtype == torch.float16 for m in mods)  # a GGUF's scales kept
    faithful_out = [m(x[m.in_features]) for m in mods]
    for m, choice in zip(mods, before, strict=True):
        m.set_kernels(choice)
    for m, want in zip(mods, int8_out, strict=True):
        assert torch.equal(m(x[m.in_features]), want)  # the int8 path exactly as before
    for m, want in zip(mods, faithful_out, strict=True):  # and the faithful one is the float
        exact = x[m.in_features].double() @ m.dequantize_rows(
            torch.arange(m.out_features)).double().T
        assert torch.allclose(want.double(), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(kf.load() is None or quant_kernels() is None,
                    reason="CPU kernels unavailable")
def test_unmeasured_auto_is_the_documented_default():
    mods = _modules(torch.Generator().manual_seed(4))
    model = torch.nn.ModuleList(mods)
    got = apply_activation_precision(model, "auto")
    want = "float32" if kf.float32_isa() == "avx512" else "int8"
    assert got == want == choose("auto")[0]
    assert all(m.kernels.activation == want for m in mods)


def test_a_burst_over_one_measurement_leaves_the_default():
    """A burst of load over the faithful side of one measurement (every run 1.9x: what a busy
    start measured once in eight) is not a verdict: the second measurement disagrees, the
    runs decided together do not separate, and the documented default stands. Two
    measurements that agree are one."""
    calm = ActivationMeasure((1.05, 1.06, 1.05, 1.07), (1.0, 1.01, 1.0, 1.02))
    burst = ActivationMeasure((1.9, 1.95, 1.92, 1.9), (1.0, 1.01, 1.0, 1.02))
    slow = ActivationMeasure((1.8, 1.82, 1.85, 1.8), (1.0, 1.0, 1.01, 1.0))
    assert decide(burst, MARGIN) == "int8"

    def sequence(*ms):
        it = iter(ms)
        calls = []

        def once():
            calls.append(1)
            return next(it)
        return once, calls

    once, calls = sequence(burst, calm)
    got, verdict = confirmed(once, "float32", MARGIN)
    assert verdict is None and len(calls) == 2 and len(got.faithful_runs) == 8
    once, calls = sequence(burst, slow)
    assert confirmed(once, "float32", MARGIN)[1] == "int8"  # truly slower: int8, measured twice
    once, calls = sequence(calm)
    assert confirmed(once, "float32", MARGIN)[1] == "float32" and len(calls) == 1
    once, calls = sequence(calm, burst)  # on AVX2 the default is int8: float32 needs two too
    assert confirmed(once, "int8", MARGIN)[1] is None
