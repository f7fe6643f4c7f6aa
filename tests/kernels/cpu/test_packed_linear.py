"""Packed linears (our AVX2 panel kernel, oneDNN) against F.linear, and a packed model against
the same model unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.packed_linear import (
    PackedLinear,
    linear_backend,
    onednn_linear_available,
    pack_linears,
    panel_kernels_available,
)

CPU = torch.device("cpu")
PANELS = panel_kernels_available(CPU, torch.float32)
ONEDNN = onednn_linear_available(CPU, torch.float32)
BACKENDS = [pytest.param("avx2-panels", marks=pytest.mark.skipif(not PANELS, reason="no AVX2")),
            pytest.param("onednn", marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN")),
            pytest.param("hybrid", marks=pytest.mark.skipif(not (PANELS and ONEDNN),
                                                            reason="needs both"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 300])  # hybrid: 300 goes to oneDNN
@pytest.mark.parametrize("out_features", [96, 37])  # a whole number of panels, and a ragged one
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(backend, rows, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    w = torch.randn(out_features, 40, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    layer = PackedLinear(w, b, backend)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # [..., in] inputs and non-contiguous rows work too
    x3 = torch.randn(2, rows, 80, generator=gen)[..., ::2]
    torch.testing.assert_close(layer(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_linears_swaps_every_linear_and_keeps_outputs(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(5, 16)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model, backend) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backend_choice_and_env_switch(monkeypatch):
    if PANELS and ONEDNN:
        assert linear_backend(CPU, torch.float32, linear_bytes=10**6) == "hybrid"
        assert linear_backend(CPU, torch.float32, linear_bytes=10**11) == "avx2-panels"
    monkeypatch.setenv("KVSERVE_PACKED_LINEAR", "onednn")
    assert linear_backend(CPU, torch.float32) == ("onednn" if ONEDNN else None)
    monkeypatch.setenv("KVSERVE_PACKED_LINEAR", "0")
    assert linear_backend(CPU, torch.float32) is None
    assert linear_backend(torch.device("meta"), torch.float32) is None
