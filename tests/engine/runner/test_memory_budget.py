"""KV budget arithmetic (engine/runner/memory.py) on mocked device figures: an idle H200, a shared one,
the free-memory bound, a budget that cannot be met, the reserve; and, with CUDA, a real capture.

Expected budgets are written out from the figures of each scenario (what a user would add up
by hand), not from the module's own intermediate fields."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.runner.memory import KVBudget, MemorySnapshot, default_reserve, kv_cache_budget

GIB = 1024**3
MIB = 1024**2
GB = 10**9
H200 = int(139.8 * GIB)  # what torch reports for a "141 GB" H200
CONTEXT = 600 * MIB  # CUDA context + cuBLAS handles outside the caching allocator
WEIGHTS = 16 * GB  # an 8B model in bf16
ACTIVATIONS = int(1.5 * GIB)  # the profiled step's peak above the weights


def snapshot(other: int = 0, weights: int = WEIGHTS, activations: int = ACTIVATIONS,
             cached: int = 20 * MIB, total: int = H200) -> MemorySnapshot:
    """Figures after profiling and ``empty_cache``: PyTorch holds the weights plus ``cached``,
    ``other`` bytes belong to other processes."""
    reserved = weights + cached
    return MemorySnapshot(total=total, free=total - CONTEXT - other - reserved,
                          torch_reserved=reserved, torch_allocated=weights,
                          torch_peak=weights + activations)


def test_idle_h200_with_a_16gb_model():
    b = kv_cache_budget(snapshot(), 0.9)
    reserve = int(H200 * 0.02)
    assert b.budget == int(0.9 * H200) - CONTEXT - (WEIGHTS + ACTIVATIONS) - reserve
    assert 100 * GIB < b.budget < 110 * GIB
    assert (b.non_torch, b.model_peak, b.activation_headroom, b.reserve) == (
        CONTEXT, WEIGHTS + ACTIVATIONS, ACTIVATIONS, reserve)
    line = b.describe()
    assert "0.90 x 139.8 GiB" in line and "0.6 GiB other processes" in line
    assert f"{b.budget / GIB:.1f} GiB" in line and "\n" not in line


def test_another_process_counts_against_the_utilization():
    idle = kv_cache_budget(snapshot(), 0.9)
    shared = kv_cache_budget(snapshot(other=40 * GB), 0.9)
    assert shared.non_torch == CONTEXT + 40 * GB
    assert shared.budget == idle.budget - 40 * GB


def test_budget_never_exceeds_what_can_be_had_now():
    """free + PyTorch's unallocated cache - activation headroom - reserve bounds the budget,
    with equality at utilization 1; including figures that do not add up (reserved > used)."""
    for other, cached, util in itertools.product([0, 40 * GB, 80 * GB], [0, 5 * GIB],
                                                 [0.8, 0.95, 1.0]):
        s = snapshot(other=other, cached=cached)
        b = kv_cache_budget(s, util)
        can_have = (s.free + (s.torch_reserved - s.torch_allocated)
                    - (s.torch_peak - s.torch_allocated) - b.reserve)
        assert b.budget <= can_have
        if util == 1.0:
            assert b.budget == can_have
    odd = MemorySnapshot(total=H200, free=H200 - 10 * GIB, torch_reserved=20 * GIB,
                         torch_allocated=16 * GIB, torch_peak=18 * GIB)
    b = kv_cache_budget(odd, 1.0)
    assert b.non_torch == 0
    assert b.budget <= odd.free + odd.torch_reserved - odd.torch_peak - b.reserve


def test_nearly_full_device_leaves_only_what_is_free():
    s = snapshot(other=110 * GB)
    b = kv_cache_budget(s, 1.0)
    assert b.budget == s.free + s.torch_reserved - s.torch_peak - b.reserve
    assert b.budget < s.free < 25 * GIB


@pytest.mark.parametrize("util,other", [(0.12, 0), (0.9, 120 * GB)])
def test_no_room_left_raises_naming_the_figures(util, other):
    with pytest.raises(ValueError) as e:
        kv_cache_budget(snapshot(other=other), util)
    msg = str(e.value)
    assert f"--gpu-memory-utilization {util:.2f}" in msg
    assert "139.8 GiB" in msg  # device total
    assert f"{(CONTEXT + other) / GIB:.1f} GiB" in msg  # other processes + context
    assert f"{(WEIGHTS + ACTIVATIONS) / GIB:.1f} GiB" in msg  # model peak
    for fix in ("--max-num-batched-tokens", "--max-model-len", "--kv-cache-memory"):
        assert fix in msg


def test_reserve_default_and_override():
    assert default_reserve(H200) == int(H200 * 0.02)  # 2.8 GiB on an H200
    assert default_reserve(8 * GIB) == 256 * MIB  # floor on small devices
    base = kv_cache_budget(snapshot(), 0.9)
    assert kv_cache_budget(snapshot(), 0.9, reserve=0).budget == base.budget + base.reserve
    assert kv_cache_budget(snapshot(), 0.9, reserve=GIB).reserve == GIB


@pytest.mark.parametrize("util", [0.0, -0.1, 1.01])
def test_rejects_bad_utilization(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_budget(snapshot(), util)


def test_rejects_bad_snapshot_and_reserve():
    with pytest.raises(ValueError, match="implausible"):
        MemorySnapshot(total=GIB, free=2 * GIB, torch_reserved=0, torch_allocated=0,
                       torch_peak=0)
    with pytest.raises(ValueError, match="reserve"):
        kv_cache_budget(snapshot(), 0.9, reserve=-1)


def test_peak_below_allocated_counts_allocated():
    """A peak reset after the weights were loaded must not hide them."""
    s = MemorySnapshot(total=H200, free=H200 - CONTEXT - WEIGHTS, torch_reserved=WEIGHTS,
                       torch_allocated=WEIGHTS, torch_peak=0)
    assert kv_cache_budget(s, 0.9).model_peak == WEIGHTS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_on_cuda():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(dev)
    x = torch.empty(256 * MIB, dtype=torch.uint8, device=dev)
    del x
    s = MemorySnapshot.capture(dev)
    assert s.torch_peak >= 256 * MIB and s.torch_allocated <= s.torch_reserved
    assert s.total - s.free >= s.torch_reserved  # the context is on the device too
    assert isinstance(kv_cache_budget(s, 0.9), KVBudget)
