"""HostTierCopier (engine/kv_cache/host/copier.py) against the reference ``copy_blocks`` run synchronously:
both directions, several layers, in the synchronous CPU mode and in the staged mode (forced on
CPU: deferred write-backs, same-call dependencies, reuse across steps); with CUDA, the real
side-stream path into pinned host pools."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv_cache.host.copier import HostTierCopier
from engine.kv_cache.host.memory import allocate_host_pools
from kvserve_kernels import reference as ref

BLOCK = (4, 2, 8)  # block_size, kv_heads, head_dim
LAYERS = 3


def _pools(num_blocks, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(num_blocks, *BLOCK, generator=g).to(dtype).to(device)
                  for _ in range(2)) for _ in range(LAYERS)]


def _flat(pools):
    return [t for kv in pools for t in kv]


def _clone(pools):
    return [tuple(t.cpu().clone() for t in kv) for kv in pools]


def _reference(dev, host, d2h, h2d):
    """The truth: d2h then h2d, each a reference copy_blocks over every layer's K and V."""
    if d2h:
        ref.copy_blocks(_flat(dev), _flat(host), torch.tensor(d2h, dtype=torch.int64))
    if h2d:
        ref.copy_blocks(_flat(host), _flat(dev), torch.tensor(h2d, dtype=torch.int64))


def _assert_equal(got, expect):
    for g, e in zip(_flat(got), _flat(expect), strict=True):
        assert torch.equal(g.cpu(), e)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_land_in_both_directions(staged, dtype):
    dev, host = _pools(6, 1, dtype), _pools(8, 2, dtype)
    want_dev, want_host = _clone(dev), _clone(host)
    d2h, h2d = [(0, 7), (3, 1), (3, 4)], [(2, 5), (6, 0)]
    _reference(want_dev, want_host, d2h, h2d)
    c = HostTierCopier(dev, host, "cpu", staged=staged)
    c.copy(d2h, h2d)
    _assert_equal(dev, want_dev)  # the device side is done when copy returns
    c.wait_d2h()
    _assert_equal(host, want_host)


def test_staged_write_backs_land_before_the_next_step_reads_them():
    dev, host = _pools(6, 3), _pools(8, 4)
    want_dev, want_host = _clone(dev), _clone(host)
    c = HostTierCopier(dev, host, "cpu", staged=True)
    steps = [([(1, 2), (4, 3)], []), ([(0, 5)], [(2, 1), (3, 4)]), ([], [(5, 0)])]
    for d2h, h2d in steps:
        _reference(want_dev, want_host, d2h, h2d)
        c.copy(d2h, h2d)  # no wait_d2h between steps: copy does it first
        _assert_equal(dev, want_dev)
    c.wait_d2h()
    _assert_equal(host, want_host)


def test_h2d_reading_a_block_written_back_in_the_same_call():
    dev, host = _pools(6, 5), _pools(8, 6)
    want_dev, want_host = _clone(dev), _clone(host)
    d2h, h2d = [(2, 3)], [(3, 5), (0, 2)]  # device block 2 also receives a load
    _reference(want_dev, want_host, d2h, h2d)
    c = HostTierCopier(dev, host, "cpu", staged=True)
    c.copy(d2h, h2d)
    _assert_equal(dev, want_dev)
    c.wait_d2h()
    _assert_equal(host, want_host)


@pytest.mark.parametrize("staged", [False, True])
def test_random_steps_match_the_reference(staged):
    rng = random.Random(7)
    dev, host = _pools(10, 8), _pools(12, 9)
    want_dev, want_host = _clone(dev), _clone(host)
    c = HostTierCopier(dev, host, "cpu", staged=staged)
    for _ in range(30):
        d_dst = rng.sample(range(12), rng.randint(0, 4))
        h_dst = rng.sample(range(10), rng.randint(0, 4))
        d2h = [(rng.randrange(10), h) for h in d_dst]
        h2d = [(rng.randrange(12), d) for d in h_dst]
        _reference(want_dev, want_host, d2h, h2d)
        c.copy(d2h, h2d)
        _assert_equal(dev, want_dev)
    c.wait_d2h()
    _assert_equal(host, want_host)


def test_empty_step_is_a_no_op():
    dev, host = _pools(3, 10), _pools(3, 11)
    before = _clone(dev), _clone(host)
    c = HostTierCopier(dev, host, "cpu", staged=True)
    c.copy([], [])
    c.wait_d2h()
    _assert_equal(dev, before[0])
    _assert_equal(host, before[1])


@pytest.mark.parametrize("d2h,h2d,match", [
    ([(6, 0)], [], "device block ids"),
    ([(0, 8)], [], "host block ids"),
    ([], [(8, 0)], "host block ids"),
    ([(0, 1), (2, 1)], [], "distinct"),
    ([], [(0, 1), (2, 1)], "distinct"),
])
def test_rejects_bad_block_ids(d2h, h2d, match):
    c = HostTierCopier(_pools(6, 0), _pools(8, 0), "cpu", staged=True)
    with pytest.raises(ValueError, match=match):
        c.copy(d2h, h2d)


def test_rejects_mismatched_pools():
    with pytest.raises(ValueError, match="layers"):
        HostTierCopier(_pools(4, 0), _pools(4, 0)[:2], "cpu")
    with pytest.raises(ValueError, match="block shape and dtype"):
        HostTierCopier(_pools(4, 0), _pools(4, 0, torch.bfloat16), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pin", [False, True])
def test_cuda_side_stream_into_host_pools(pin):
    dev = _pools(16, 12, torch.bfloat16, "cuda")
    host = allocate_host_pools(LAYERS, (20, *BLOCK), torch.bfloat16, pin=pin)
    for t in _flat(host.layers):
        t.copy_(torch.randn(t.shape).to(t.dtype))
    want_dev, want_host = _clone(dev), _clone(host.layers)
    c = HostTierCopier(dev, host.layers, "cuda")
    rng = random.Random(3)
    for _ in range(20):
        d2h = [(rng.randrange(16), h) for h in rng.sample(range(20), rng.randint(0, 5))]
        h2d = [(rng.randrange(20), d) for d in rng.sample(range(16), rng.randint(0, 5))]
        _reference(want_dev, want_host, d2h, h2d)
        c.copy(d2h, h2d)
        for k, v in dev + want_dev:  # compute-stream work (exact in bf16) after the copy:
            k.neg_()  # it must see the loaded blocks, and the write-backs must not see it
            v.mul_(2)
    torch.cuda.synchronize()
    _assert_equal(dev, want_dev)
    c.wait_d2h()
    _assert_equal(host.layers, want_host)
