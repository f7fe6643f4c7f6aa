"""Triton layer ops (kvserve_kernels/fused_ops.py) vs the PyTorch arithmetic they replace."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE

pytest.importorskip("triton")
from engine.models.layer_ops import TorchLayerOps, TritonLayerOps, check_against_torch  # noqa: E402

REF = TorchLayerOps()
# float32: rounding only. bfloat16: one bf16 ulp at the magnitudes here (products of N(0, 1)
# values reach ~8, where an ulp is 1/16). On a GPU _close also wants >= 98% of elements
# bit-equal; Triton's CPU interpreter does not round bf16 as the GPU does, so not there.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (0.13, 0.016)}


def _close(got, expected):
    atol, rtol = TOL[got.dtype]
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    if got.dtype == torch.bfloat16 and got.is_cuda:
        assert (got == expected).float().mean() >= 0.98


def _rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_silu_match_torch(dtype):
    ops = TritonLayerOps()
    x, res, w = _rand(7, 96, dtype=dtype), _rand(7, 96, dtype=dtype, seed=1), \
        _rand(96, dtype=dtype, seed=2)
    _close(ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5))
    residual = res.clone()
    normed, summed = ops.add_rms_norm(x, residual, w, 1e-5)
    exp_n, exp_s = REF.add_rms_norm(x, res.clone(), w, 1e-5)
    assert summed.data_ptr() == residual.data_ptr()  # the sum reuses the residual's storage
    _close(summed, exp_s)
    _close(normed, exp_n)
    gu = _rand(7, 2 * 80, dtype=dtype, seed=3)
    _close(ops.silu_mul(gu), REF.silu_mul(gu))


def test_self_check_passes_and_reports_a_broken_op():
    assert check_against_torch(TritonLayerOps(), DEVICE, torch.float32) is None

    class Broken(TritonLayerOps):
        def silu_mul(self, gate_up):
            return super().silu_mul(gate_up) * 2

    reason = check_against_torch(Broken(), DEVICE, torch.float32)
    assert reason is not None and "AssertionError" in reason
