"""copy_blocks against the reference: within a pool, between pools/lists, Triton kernel
(interpreted on CPU), across devices when CUDA is present, and argument validation."""

from __future__ import annotations

import pytest
import torch

from kvserve_kernels import reference as ref
from kvserve_kernels.copy_blocks import copy_blocks
from tests.kernels.conftest import DEVICE

BLOCK = (8, 2, 16)  # block_size, kv_heads, head_dim: small blocks keep the interpreter fast


def _pools(n_layers, num_blocks, dtype=torch.float32, device="cpu", seed=0, pin=False):
    g = torch.Generator().manual_seed(seed)
    pools = [torch.randn(num_blocks, *BLOCK, generator=g).to(dtype) for _ in range(n_layers)]
    if pin:
        pools = [p.pin_memory() for p in pools]
    return [p.to(device) for p in pools] if device != "cpu" else pools


def _expect(src, dst, mapping):
    out = [d.cpu().clone() for d in dst]
    ref.copy_blocks([s.cpu() for s in src], out, mapping.cpu())
    return out


def _assert_pools_equal(got, expect):
    for g, e in zip(got, expect, strict=True):
        assert torch.equal(g.cpu(), e)


COW = torch.tensor([[0, 5], [3, 1], [3, 4]])  # one source may feed several destinations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_within_one_pool(dtype):
    (pool,) = _pools(1, 6, dtype)
    expect = _expect([pool], [pool], COW)
    copy_blocks(pool, pool, COW)
    _assert_pools_equal([pool], expect)


def test_copy_between_cpu_layer_lists_of_different_sizes():
    src, dst = _pools(3, 6, seed=1), _pools(3, 9, seed=2)
    mapping = torch.tensor([[5, 8], [0, 0], [2, 3]])
    expect = _expect(src, dst, mapping)
    copy_blocks(src, dst, mapping)
    _assert_pools_equal(dst, expect)
    _assert_pools_equal(src, [s.clone() for s in _pools(3, 6, seed=1)])  # sources untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_layers", [1, 3])
def test_triton_copy_kernel_matches_reference(dtype, n_layers):
    pytest.importorskip("triton")
    from kvserve_kernels.copy_blocks import copy_blocks_triton

    src = _pools(n_layers, 6, dtype, DEVICE, seed=3)
    dst = _pools(n_layers, 7, dtype, DEVICE, seed=4)
    mapping = torch.tensor([[1, 6], [4, 0], [1, 2]])
    expect = _expect(src, dst, mapping)
    copy_blocks_triton(src, dst, mapping)
    _assert_pools_equal(dst, expect)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_copy_between_host_and_device(pin, direction):
    host = _pools(2, 5, torch.float16, seed=5, pin=pin)
    device = _pools(2, 7, torch.float16, "cuda", seed=6)
    src, dst = (device, host) if direction == "to_host" else (host, device)
    mapping = torch.tensor([[0, 4], [4, 1], [2, 2]])
    expect = _expect(src, dst, mapping)
    copy_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    _assert_pools_equal(dst, expect)


def test_empty_mapping_is_a_no_op():
    (pool,) = _pools(1, 3)
    before = pool.clone()
    copy_blocks(pool, pool, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("src,dst,mapping,match", [
    (_pools(2, 4), _pools(1, 4), torch.tensor([[0, 1]]), "destination pools"),
    (_pools(1, 4), [torch.zeros(4, 8, 2, 8)], torch.tensor([[0, 1]]), "pool mismatch"),
    (_pools(1, 4), _pools(1, 4), torch.tensor([0, 1]), r"\[N, 2\]"),
    (_pools(1, 4), _pools(1, 4), torch.tensor([[0, 1]], dtype=torch.int32), "int64"),
    (_pools(1, 4), _pools(1, 2), torch.tensor([[3, 2]]), "outside"),
    (_pools(1, 4), _pools(1, 4), torch.tensor([[-1, 2]]), "outside"),
])
def test_copy_blocks_rejects_bad_arguments(src, dst, mapping, match):
    with pytest.raises(ValueError, match=match):
        copy_blocks(src, dst, mapping)
