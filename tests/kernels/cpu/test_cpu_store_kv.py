"""The CPU pool writer ``store_kv_cpu`` (engine/cpu/csrc/kv_store_cpu.cpp) against
``kvserve_kernels.reference.store_kv``: bit-exact pools for float, bf16, int8-row and fp8 pools,
strided (non-contiguous) K/V as the QKV split gives them, negative slots skipped, bad slots
refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.kernels import load
from kvserve_kernels import reference as ref

kernels = load()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels unavailable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
@pytest.mark.parametrize(("kvh", "width"), [(1, 64), (3, 66), (2, 128)])
def test_store_kv_cpu_equals_the_reference(dtype, kvh, width):
    g = torch.Generator().manual_seed(kvh * width)
    nb, bs, t = 6, 4, 9
    shape = (nb, bs, kvh, width)

    def rand(*s):
        x = torch.randn(*s, generator=g) * 50
        return x.to(dtype) if dtype.is_floating_point else x.clamp(-128, 127).to(torch.int8).view(dtype)

    k_cache, v_cache = rand(*shape), rand(*shape)
    # K and V as strided views of one fused row buffer, like the QKV projection's split.
    fused = rand(t, 2 * kvh * width)
    k = fused[:, : kvh * width].view(t, kvh, width)
    v = fused[:, kvh * width:].view(t, kvh, width)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[0, 5]] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, k_ref, v_ref, slots)
    kernels.store_kv_cpu(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_cpu_refuses_a_slot_outside_the_pool_before_writing():
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.store_kv_cpu(k, k, k_cache, v_cache, torch.tensor([0, 8]))
    assert not k_cache.any()
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.store_kv_cpu(k.bfloat16(), k.bfloat16(), k_cache, v_cache, torch.tensor([0, 1]))
