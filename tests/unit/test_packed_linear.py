"""oneDNN packed linears against F.linear, and a packed model against the same model unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.packed_linear import PackedLinear, onednn_linear_available, pack_linears

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not onednn_linear_available(CPU, torch.float32),
                                reason="this PyTorch build has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    layer = PackedLinear(w, b)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # [..., in] inputs and non-contiguous rows work too
    x3 = torch.randn(2, rows, 80, generator=gen)[..., ::2]
    torch.testing.assert_close(layer(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def test_pack_linears_swaps_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(5, 16)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("KVSERVE_ONEDNN_LINEAR", "0")
    assert not onednn_linear_available(CPU, torch.float32)
    assert not onednn_linear_available(torch.device("meta"), torch.float32)
