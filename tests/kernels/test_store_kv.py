"""Triton store_kv against the reference: bit-exact pools, -1 slots skipped."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE

pytest.importorskip("triton")
from kvserve_kernels import reference as ref  # noqa: E402
from kvserve_kernels.store_kv import store_kv  # noqa: E402


def _run_both(key, value, pool_shape, cache_dtype, slots):
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(pool_shape, generator=g).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(pool_shape, generator=g).to(cache_dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    ref.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (3, 80), (2, 256)])
@pytest.mark.parametrize("block_size", [8, 32])
def test_store_kv_matches_reference(cache_dtype, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(4)
    num_blocks, tokens = 5, 7
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[1, 4]] = -1  # padding tokens must leave the pool untouched
    key = torch.randn(tokens, kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)
    value = torch.randn(tokens, kv_heads, head_dim, generator=g).to(cache_dtype).to(DEVICE)
    _run_both(key, value, (num_blocks, block_size, kv_heads, head_dim), cache_dtype,
              slots.to(DEVICE))


def test_store_kv_strided_fp32_inputs_into_half_pool():
    # K/V as slices of a fused projection (row stride > KVH * D), fp32 cast on store to fp16.
    g = torch.Generator().manual_seed(5)
    fused = torch.randn(6, 8, 64, generator=g).to(DEVICE)
    key, value = fused[:, 4:6], fused[:, 6:8]
    slots = torch.tensor([0, 17, 5, -1, 31, 8], device=DEVICE)
    _run_both(key, value, (4, 8, 2, 64), torch.float16, slots)


def test_store_kv_all_slots_skipped_leaves_pool_unchanged():
    key = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    _run_both(key, key.clone(), (2, 16, 2, 64), torch.float32, slots)


def test_store_kv_rejects_mismatched_shapes():
    pool = torch.zeros(2, 8, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="KVH, D"):
        store_kv(key, key, pool, pool.clone(), torch.zeros(3, dtype=torch.int64, device=DEVICE))
    key = torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, pool, pool.clone(), torch.zeros(2, dtype=torch.int64, device=DEVICE))
