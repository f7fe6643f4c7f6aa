"""allocate_host_pools (engine/kv_cache/host/memory.py): exact flat size, aligned non-overlapping writable
views, lifetime; pinning through a fake cudart on CPU (register once, unregister once, failure
kept unpinned with a warning) and through the real one when CUDA is present."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from engine.kv_cache.host import memory as host_pool
from engine.kv_cache.host.memory import ALIGN, allocate_host_pools

SHAPE = (5, 4, 2, 8)  # blocks, block_size, kv_heads, head_dim


def _views(p):
    return [t for kv in p.layers for t in kv]


def _span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_views_have_the_asked_shape_and_do_not_overlap(dtype, num_layers):
    p = allocate_host_pools(num_layers, SHAPE, dtype, pin=False)
    views = _views(p)
    assert len(p.layers) == num_layers and not p.pinned
    lo, hi = _span(p.buffer)
    spans = sorted(_span(t) for t in views)
    for t in views:
        assert t.shape == SHAPE and t.dtype == dtype and t.is_contiguous()
        assert t.device.type == "cpu" and t.data_ptr() % ALIGN == 0
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert lo <= spans[0][0] and spans[-1][1] <= hi


def test_flat_size_is_the_sum_plus_alignment_padding():
    p = allocate_host_pools(4, SHAPE, torch.float16, pin=False)  # 640 B a view: pads to 768
    view_bytes = 5 * 4 * 2 * 8 * 2
    assert p.nbytes == p.buffer.numel() == 8 * 768
    assert 0 <= p.nbytes - 8 * view_bytes < 8 * ALIGN
    exact = allocate_host_pools(60, (16, 16, 8, 128), torch.bfloat16, pin=False)
    assert exact.nbytes == 60 * 2 * 16 * 16 * 8 * 128 * 2  # block-sized views need no padding


def test_views_are_written_independently():
    p = allocate_host_pools(3, SHAPE, torch.float32, pin=False)
    views = _views(p)
    for i, t in enumerate(views):
        t.fill_(i + 1)
    for i, t in enumerate(views):
        assert torch.all(t == i + 1)
    views[2][3].zero_()
    assert torch.all(views[2][3] == 0) and torch.all(views[2][4] == 3)
    assert torch.all(views[1] == 2) and torch.all(views[3] == 4)


def test_views_outlive_the_pools_object():
    p = allocate_host_pools(2, SHAPE, torch.float32, pin=False)
    k0 = p.layers[0][0]
    del p
    gc.collect()
    k0.fill_(7.0)
    assert torch.all(k0 == 7.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pin_without_cuda_is_refused():
    with pytest.raises(ValueError, match="need a CUDA device"):
        allocate_host_pools(2, SHAPE, torch.float32, pin=True)


@pytest.mark.parametrize("num_layers,shape", [(0, SHAPE), (2, ()), (2, (0, 4, 2, 8))])
def test_rejects_bad_arguments(num_layers, shape):
    with pytest.raises(ValueError, match="host pools need"):
        allocate_host_pools(num_layers, shape, torch.float32, pin=False)


class FakeCudart:
    """Records calls; returns ``rc`` from cudaHostRegister (0 = cudaSuccess)."""

    def __init__(self, rc=0):
        self.rc = rc
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA name
        self.registered.append((ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, rc):  # noqa: N802
        return "out of memory"


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(cudart):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
        monkeypatch.setattr(host_pool, "_clear_cuda_error", lambda: None)
        return cudart
    return install


def test_pin_registers_the_exact_range_once_and_unregisters_once(fake_cuda):
    cudart = fake_cuda(FakeCudart())
    p = allocate_host_pools(3, SHAPE, torch.bfloat16, pin=True)
    assert p.pinned
    ((ptr, size, flags),) = cudart.registered
    assert ptr == p.buffer.data_ptr() and ptr % host_pool._PAGE == 0 and flags == 0
    assert p.nbytes <= size < p.nbytes + host_pool._PAGE  # the buffer, in whole pages
    p.close()
    p.close()
    assert cudart.unregistered == [ptr] and not p.pinned
    p.layers[0][0].fill_(1.0)  # still usable, pageable


def test_pin_unregisters_when_the_last_view_dies(fake_cuda):
    cudart = fake_cuda(FakeCudart())
    p = allocate_host_pools(2, SHAPE, torch.float32, pin=True)
    v = p.layers[1][1]
    del p
    gc.collect()
    assert cudart.unregistered == []  # a view still uses the memory
    del v
    gc.collect()
    assert cudart.unregistered == [cudart.registered[0][0]]


def test_failed_registration_warns_and_keeps_the_buffer_unpinned(fake_cuda, caplog):
    cudart = fake_cuda(FakeCudart(rc=2))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        p = allocate_host_pools(2, SHAPE, torch.float32, pin=True)
    assert not p.pinned and "cudaHostRegister" in caplog.text and "not pinned" in caplog.text
    p.layers[0][1].fill_(2.0)
    p.close()
    del p
    gc.collect()
    assert cudart.unregistered == []


def test_missing_binding_warns_and_keeps_the_buffer_unpinned(fake_cuda, caplog):
    fake_cuda(object())
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        p = allocate_host_pools(1, SHAPE, torch.float32, pin=True)
    assert not p.pinned and "not pinned" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_pinning_on_cuda():
    p = allocate_host_pools(2, SHAPE, torch.float16, pin=True)
    # (torch's is_pinned() does not see cudaHostRegister'd memory: the return code is the test)
    assert p.pinned
    src = torch.randn(SHAPE, device="cuda").half()
    p.layers[1][0].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(p.layers[1][0], src.cpu())
    back = p.layers[1][0].to("cuda", non_blocking=True)
    assert torch.equal(back, src)
    p.close()
