"""The start-up probe under noise (issue 65): a verdict only where the candidates' ranges of
runs separate, the packed weights otherwise, never float weights beyond the memory allowed.

The probe is driven end to end (``choose`` over real packed modules, every setting probe
included) with an injected timer whose runs are a true time plus random stalls, as another
busy process on the machine adds them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from engine.quantization import probe as quant_probe
from engine.quantization.linear import QuantisedModules, QuantLinear, quant_kernels
from engine.quantization.probe import SEPARATION, ProbeResult, choose
from engine.weight_prep import apply as quant_apply

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="CPU kernels unavailable")


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(64, 96, bias=False)
        self.down_proj = nn.Linear(64, 64, bias=False)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer()])
        self.lm_head = None


def _packed(weight: torch.Tensor, qtype) -> QuantLinear:
    from gguf import quants

    from engine.quantization.gguf_blocks import from_gguf_blocks

    raw = quants.quantize(weight.detach().numpy().astype(np.float32), qtype)
    return QuantLinear(from_gguf_blocks(raw, int(qtype), tuple(weight.shape)))


def _model_and_modules() -> tuple[nn.Module, QuantisedModules]:
    from gguf import GGMLQuantizationType as T

    torch.manual_seed(0)
    model = _Model()
    q = QuantisedModules()
    layer = model.layers[0]
    q.linears["layers.0.qkv_proj"] = _packed(layer.qkv_proj.weight, T.Q4_0)
    q.linears["layers.0.down_proj"] = _packed(layer.down_proj.weight, T.Q8_0)
    return model, q


JITTER = 0.02  # every run: up to 2% over its true time


def _noisy_timer(rng: random.Random, true_s: tuple[float, float], stall_p: float = 0.3,
                 stall_max: float = 10.0):
    """Each run: its side's true time, plus (with probability ``stall_p``) a stall of up to
    ``stall_max`` times it, plus a little jitter; stalls only ever add time."""
    def timer(run, side: int) -> float:
        t = true_s[side] * (1 + JITTER * rng.random())
        if rng.random() < stall_p:
            t += true_s[side] * stall_max * rng.random()
        return t
    return timer


@pytest.mark.parametrize("float_advantage", [0.0, 0.02, (SEPARATION - JITTER) * 0.99])
def test_noise_never_inflates_a_packed_file(float_advantage):
    """Float truly faster by less than the separation margin (or not at all), runs stalled at
    random up to 10x: across many seeds the packed weights serve every row count. The margin
    is relative to the faster side (``decision``: ``max(f) * (1 + SEPARATION) < min(q)``), so
    float's true time is ``1 / (1 + advantage)`` of the packed one's, and the advantage stays
    under the margin less the runs' jitter, which can make up the rest on every run of the
    slower side (at ``1 - 0.0495`` float's clean runs won at 64 rows under some seeds, on an
    AVX2 machine whose probes draw the random runs in another order: 5 of 200 seeds)."""
    model, q = _model_and_modules()
    for seed in range(40):
        timer = _noisy_timer(random.Random(seed), (1.0 / (1.0 + float_advantage), 1.0))
        verdict = choose(model, q, timer=timer)
        assert verdict.mode == "quant", (seed, verdict.describe())
        assert verdict.float_above is None


def test_memory_not_allowed_never_inflates_even_when_float_is_clearly_faster():
    model, q = _model_and_modules()
    timer = _noisy_timer(random.Random(0), (0.2, 1.0), stall_p=0.0)  # float 5x faster, clean
    assert choose(model, q, timer=timer).mode == "float"  # measured: float would win ...
    verdict = choose(model, q, timer=timer, float_allowed=False)
    assert verdict.mode == "quant" and verdict.probes == {}  # ... but may not: not even probed


def test_a_4bit_gguf_may_not_keep_float_weights():
    """Float32 copies of 4-bit weights are ~7x their packed bytes: beyond the 1.3x that
    quantization=auto allows, so adopt_if_faster never probes float against them."""
    model, q = _model_and_modules()
    reason = quant_apply.float_memory_reason(model, q)
    assert reason is not None and "quantization=auto allows" in reason
    assert quant_apply.float_memory_reason(model, q, factor=100.0) is None


def test_adopt_keeps_packed_weights_whatever_the_timer_says(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_QUANT_FORCE", raising=False)
    monkeypatch.setattr(quant_probe, "probe", lambda *a, **k: pytest.fail("float probed"))
    model, q = _model_and_modules()
    verdict = quant_apply.adopt_if_faster(model, q, cpu_probe="force")
    assert verdict.mode == "quant"
    assert isinstance(model.layers[0].qkv_proj, QuantLinear)  # swapped in, float dropped


def test_noisy_verdicts_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_QUANT_REPROBE", raising=False)
    model, q = _model_and_modules()
    timer = _noisy_timer(random.Random(3), (1.0, 1.0), stall_p=0.6)
    verdict, how = quant_apply._cached_or_probed(model, q, force=False, timer=timer)
    assert verdict.mode == "quant" and not verdict.confirmed and "not cached" in how
    assert not list(tmp_path.rglob("*.json"))
    quiet = _noisy_timer(random.Random(4), (1.0, 1.0), stall_p=0.0)
    verdict, how = quant_apply._cached_or_probed(model, q, force=False, timer=quiet)
    assert verdict.confirmed and "cached for later" in how and list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize(("float_runs", "quant_runs", "want"), [
    ((1.0, 1.0, 1.01), (0.5, 0.5, 0.51), "quant"),
    ((0.5, 0.5, 0.51), (1.0, 1.0, 1.01), "float"),
    ((1.0, 1.01, 1.02), (0.99, 1.0, 1.01), None),  # within the margin: no verdict
    ((1.0, 9.0, 1.0, 1.0), (0.5, 0.5, 0.5, 0.5), "quant"),  # one stall dropped
    ((0.5, 3.0, 4.0), (1.0, 1.1, 1.0), None),  # ranges overlap
])
def test_decision_needs_separated_ranges(float_runs, quant_runs, want):
    r = ProbeResult(min(float_runs), min(quant_runs), float_runs, quant_runs)
    assert r.decision == want
