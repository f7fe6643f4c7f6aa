"""The compiled CPU paged-decode kernel against the PyTorch reference in kernels/reference.py."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.kernels import load
from kernels.reference import paged_decode_attention


@pytest.fixture(scope="module")
def kernel():
    module = load()
    assert module is not None, "the CPU paged-decode kernel failed to build (see the warning)"
    return module


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_reference(kernel, heads, kv_heads, block_size, window):
    gen = torch.Generator().manual_seed(heads * 100 + block_size + (window or 0))
    head_dim, num_blocks = 64, 64
    seq_lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size, 37], dtype=torch.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    tables = tables.view(len(seq_lens), max_blocks).to(torch.int32)  # shuffled, disjoint
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    ref = paged_decode_attention(q, k, v, tables, seq_lens, 0.125, sliding_window=window)
    got = kernel.paged_decode_cpu(q, k, v, tables, seq_lens, 0.125, window or 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
