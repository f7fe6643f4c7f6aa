"""Triton paged_attention (mixed prefill / chunked prefill / decode) against the reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import TOLERANCE, make_paged_case

pytest.importorskip("triton")
from kvserve_kernels import reference as ref  # noqa: E402
from kvserve_kernels.paged_attention import paged_attention  # noqa: E402

# (seq_lens, q_lens): decodes only; whole prompts incl. length 1 and exact block multiples;
# chunked prefill and decodes mixed, over contexts crossing several blocks.
BATCHES = {
    "decodes": ([1, 16, 33], [1, 1, 1]),
    "prompts": ([1, 16, 37], [1, 16, 37]),
    "mixed": ([5, 64, 70, 9], [1, 16, 3, 9]),
}
GQA = [(2, 2), (6, 2), (4, 1), (8, 1)]  # ratios 1, 3, 4, 8


def _check(case, scale=0.125, window=None, softcap=None, **kwargs):
    out = paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                          case.cu_seqlens_q, case.seq_lens, scale, window, softcap=softcap,
                          **kwargs)
    expect = ref.paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                 case.cu_seqlens_q, case.seq_lens, scale, window, softcap)
    tol = TOLERANCE[case.k_cache.dtype]
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(out.float(), expect.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_attention_matches_reference(batch, heads, kv_heads):
    # Block size 8 < the kernel's key tile: each key finds its own page.
    seq_lens, q_lens = BATCHES[batch]
    _check(make_paged_case(seq_lens, q_lens, heads, kv_heads, 64, 8))


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_attention_tiles_within_one_page(batch):
    # Block size 32 >= the key tile (on CPU): one block-table read per tile.
    seq_lens, q_lens = BATCHES[batch]
    _check(make_paged_case(seq_lens, q_lens, 6, 2, 64, 32))


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1)])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_attention_sliding_window(batch, heads, kv_heads):
    seq_lens, q_lens = BATCHES[batch]
    _check(make_paged_case(seq_lens, q_lens, heads, kv_heads, 64, 8), window=7)


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_paged_attention_head_dims(head_dim):
    _check(make_paged_case([20, 9], [4, 9], 6, 2, head_dim, 16, strided_query=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (6, 2, 5)])
def test_paged_attention_half_precision(dtype, heads, kv_heads, window):
    case = make_paged_case([33, 12], [3, 12], heads, kv_heads, 64, 16, dtype=dtype)
    _check(case, window=window)


@pytest.mark.parametrize("block_size", [4, 128])
def test_paged_attention_small_and_large_blocks(block_size):
    _check(make_paged_case([40, 130], [40, 2], 4, 2, 64, block_size))


@pytest.mark.parametrize("window", [1, 16, 200])
def test_paged_attention_window_edges(window):
    # window 1: only the token itself; 200: wider than every context, i.e. no window.
    _check(make_paged_case([30, 50], [30, 4], 4, 2, 64, 8), window=window)


def test_paged_attention_fp32_query_over_half_cache_and_out_buffer():
    case = make_paged_case([18, 3], [2, 3], 4, 2, 64, 8, dtype=torch.float16)
    case.query = case.query.float()
    out = torch.full_like(case.query, float("nan"))
    ret = paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                          case.cu_seqlens_q, case.seq_lens, 0.125, max_query_len=3, out=out)
    assert ret is out and out.dtype == torch.float32
    expect = ref.paged_attention(case.query.half(), case.k_cache, case.v_cache,
                                 case.block_tables, case.cu_seqlens_q, case.seq_lens, 0.125)
    torch.testing.assert_close(out, expect.float(), atol=2e-3, rtol=2e-3)


def test_paged_attention_rejects_bad_shapes():
    case = make_paged_case([8], [8], 3, 2, 64, 8)
    with pytest.raises(ValueError, match="multiple"):
        _check(case)
    case = make_paged_case([8], [8], 4, 2, 64, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                        case.cu_seqlens_q[:1], case.seq_lens, 0.1)


@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_softcap(window):
    """Gemma 2's soft-capped scores over mixed decodes, prompts and chunks (scale 1, cap 2:
    most scores bent)."""
    seq_lens, q_lens = BATCHES["mixed"]
    _check(make_paged_case(seq_lens, q_lens, 8, 1, 64, 8), scale=1.0, window=window,
           softcap=2.0)
