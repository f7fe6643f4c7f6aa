"""The compiled fused CPU ops (engine/cpu/csrc/fused_ops_cpu.cpp) against the PyTorch layer ops,
which are HF's arithmetic."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.kernels import load
from engine.models.arch import RopeSpec
from engine.models.layer_ops import FusedCpuOps, TorchLayerOps, layer_ops_for
from engine.models.rope import RotaryEmbedding

REF = TorchLayerOps()


@pytest.fixture(scope="module")
def fused():
    module = load()
    assert module is not None, "the CPU kernels failed to build (see the warning)"
    return FusedCpuOps(module)


def test_picks_fused_ops_for_float32_cpu_only(fused):
    assert layer_ops_for(torch.device("cpu"), torch.float32).name == "fused-cpu"
    assert layer_ops_for(torch.device("cpu"), torch.bfloat16).name == "torch"


@pytest.mark.parametrize("rows,dim", [(1, 576), (5, 64), (37, 100), (300, 576)])
def test_rms_norm_and_add(fused, rows, dim):
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    x = torch.randn(rows, dim, generator=gen) * 3
    res = torch.randn(rows, dim, generator=gen)
    w = torch.randn(dim, generator=gen)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    want_y, want_r = REF.add_rms_norm(x, res, w, 1e-6)
    got_y, got_r = fused.add_rms_norm(x, res.clone(), w, 1e-6)
    torch.testing.assert_close(got_r, want_r, rtol=0, atol=0)  # the add is exact
    torch.testing.assert_close(got_y, want_y)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 20), (64, 1536)])
def test_silu_mul(fused, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6  # reaches both tails of silu
    gate_up[0, :4] = torch.tensor([-120.0, -90.0, 90.0, 0.0])  # beyond exp's range both ways
    torch.testing.assert_close(fused.silu_mul(gate_up), REF.silu_mul(gate_up))


@pytest.mark.parametrize("rows,inter", [(1, 2048), (7, 20), (64, 2048)])
def test_gelu_tanh_mul(fused, rows, inter):
    """GeGLU as g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)): PyTorch's tanh form to rounding,
    both tails (exp clamped) included."""
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6
    gate_up[0, :5] = torch.tensor([-120.0, -9.0, 9.0, 120.0, 0.0])
    torch.testing.assert_close(fused.gelu_tanh_mul(gate_up), REF.gelu_tanh_mul(gate_up))


@pytest.mark.parametrize("head_dim", [64, 128, 18])
def test_rotary_in_place_on_a_strided_view(fused, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    t, heads, kv_heads = 11, 4, 2
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), head_dim, 64)
    cos, sin = rope.cos_sin(torch.randint(0, 64, (t,), generator=gen), torch.float32)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t, width, generator=gen)
    view = qkv[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    want = REF.rotary(view.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    got = fused.rotary(view, cos, sin)
    torch.testing.assert_close(got, want)
    assert got.data_ptr() == qkv.data_ptr()  # rotated in place ...
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim:], v_before, rtol=0, atol=0)
