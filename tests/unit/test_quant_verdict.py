"""The start-up choice between packed quantised and float linears (engine/models/quant_apply.py
``choose``) and the per-call routing it sets up (``QuantLinear.keep_float_above``).

The choice must follow the measurements only: the quantised path keeps the row counts it won,
contiguously from one row, and larger inputs go to the float module it replaced, so no batch
size runs on a path measured slower."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models import quant_apply
from engine.models.quant_apply import ProbeResult, QuantisedModules, choose

gguf = pytest.importorskip("gguf")


def _fake_probe(wins: dict[int, bool]):
    def probe(model, q, rows=1, repeats=5):
        return ProbeResult(float_s=1.0, quant_s=0.5 if wins[rows] else 2.0)
    return probe


@pytest.mark.parametrize(("wins", "mode", "above"), [
    ({1: True, 4: True, 16: True, 64: True, 256: True}, "quant", None),
    ({1: True, 4: True, 16: False, 64: False, 256: False}, "hybrid", 4),
    ({1: True, 4: False, 16: True, 64: True, 256: True}, "hybrid", 1),  # contiguous from 1 row
    ({1: False, 4: True, 16: True, 64: True, 256: True}, "float", None),
])
def test_choice_follows_the_measurements(monkeypatch, wins, mode, above):
    monkeypatch.setattr(quant_apply, "probe", _fake_probe(wins))
    verdict = choose(nn.Module(), QuantisedModules())
    assert (verdict.mode, verdict.float_above) == (mode, above)
    assert sorted(verdict.probes) == [1, 4, 16, 64, 256]
    assert verdict.describe().startswith("1 rows: quantised " + ("500.00" if wins[1] else "2000.00"))


def test_force_uses_the_quantised_path_for_every_size(monkeypatch):
    monkeypatch.setattr(quant_apply, "probe", _fake_probe(dict.fromkeys((1, 4, 16, 64, 256),
                                                                        False)))
    assert choose(nn.Module(), QuantisedModules(), force=True).mode == "quant"


def test_inputs_above_the_crossover_go_to_the_float_module():
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from engine.models.gguf_blocks import from_gguf_blocks
    from engine.models.quant_linear import QuantLinear, quant_kernels

    if quant_kernels() is None:
        pytest.skip("CPU kernels unavailable")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    raw = quants.quantize(w, T.Q4_0)
    dense = torch.from_numpy(quants.dequantize(raw, T.Q4_0))
    q = QuantLinear(from_gguf_blocks(raw, int(T.Q4_0), (96, 64)))
    calls = []

    class Float(nn.Module):
        def forward(self, x):
            calls.append(x.shape[0])
            return F.linear(x, dense)

    q.keep_float_above(4, Float())
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    q(x[:4])  # 4 rows: the quantised kernel
    assert calls == []
    torch.testing.assert_close(q(x), F.linear(x, dense))  # 9 rows: the float module, exactly
    assert calls == [9]
    assert q.nbytes < dense.numel() * 4 / 4  # the fallback is not counted as packed bytes
