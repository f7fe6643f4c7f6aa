"""Triton paged_decode_attention (GQA-grouped, split-K + log-sum-exp merge) vs the reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, TOLERANCE, make_paged_case

pytest.importorskip("triton")
from kvserve_kernels import reference as ref  # noqa: E402
from kvserve_kernels.paged_decode import choose_num_splits, paged_decode_attention  # noqa: E402

# Length 1, an exact block multiple (of 8 and 32) and contexts crossing several blocks.
SEQ_SETS = {"short": [1, 32, 45], "long": [97, 2]}
GQA = [(2, 2), (6, 2), (4, 1), (8, 1)]  # ratios 1, 3, 4, 8


def _decode_case(seq_lens, heads, kv_heads, head_dim=64, block_size=16, dtype=torch.float32,
                 seed=0):
    return make_paged_case(seq_lens, [1] * len(seq_lens), heads, kv_heads, head_dim,
                           block_size, dtype=dtype, seed=seed, strided_query=True)


def _check(case, num_splits, window=None, scale=0.125, softcap=None):
    out = paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                 case.seq_lens, scale, num_splits, window, softcap=softcap)
    expect = ref.paged_decode_attention(case.query, case.k_cache, case.v_cache,
                                        case.block_tables, case.seq_lens, scale,
                                        softcap=softcap)
    if window is not None:
        expect = ref.paged_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                                     case.cu_seqlens_q, case.seq_lens, scale, window, softcap)
    tol = TOLERANCE[case.k_cache.dtype]
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(out.float(), expect.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("seqs", sorted(SEQ_SETS))
def test_decode_matches_reference(seqs, heads, kv_heads, num_splits):
    # Block size 8 < the kernel's key tile: each key finds its own page.
    _check(_decode_case(SEQ_SETS[seqs], heads, kv_heads, block_size=8), num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seqs", sorted(SEQ_SETS))
def test_decode_tiles_within_one_page(seqs, num_splits):
    # Block size 32 >= the key tile (on CPU): one block-table read per tile.
    _check(_decode_case(SEQ_SETS[seqs], 6, 2, block_size=32), num_splits)


@pytest.mark.parametrize("num_splits", [2, None])
def test_decode_other_split_counts(num_splits):
    _check(_decode_case([97, 2, 33], 6, 2), num_splits)


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1)])
def test_decode_sliding_window(heads, kv_heads, num_splits, window):
    _check(_decode_case([97, 5, 40], heads, kv_heads, block_size=8), num_splits, window)


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_decode_head_dims(head_dim):
    _check(_decode_case([45, 3], 6, 2, head_dim=head_dim), 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_half_precision(dtype, num_splits):
    _check(_decode_case([70, 16], 8, 2, dtype=dtype), num_splits)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_softcap(num_splits, window):
    """Gemma 2's soft-capped scores (cap * tanh(s / cap)), split or not: scale 1 and a cap of
    2 bend most scores, so a kernel that skipped the cap would fail."""
    _check(_decode_case([97, 5, 40], 8, 1, block_size=8), num_splits, window, scale=1.0,
           softcap=2.0)


def test_decode_more_splits_than_tiles_and_block_size_4():
    # Most splits get no keys at all; their partials must carry zero weight in the merge.
    _check(_decode_case([3, 20], 4, 2, block_size=4), 16)


def test_decode_split_count_does_not_change_result_beyond_rounding():
    case = _decode_case([90, 33], 4, 1, seed=3)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.2)
    one = paged_decode_attention(*args, num_splits=1)
    many = paged_decode_attention(*args, num_splits=4)
    torch.testing.assert_close(one, many, atol=2e-6, rtol=2e-6)


def test_choose_num_splits_scales_with_batch_and_context():
    dev = torch.device("cuda") if DEVICE.type == "cuda" else torch.device("cpu")
    # Short contexts never split; a lone long sequence splits; a large batch does not.
    assert choose_num_splits(1, 8, 200, dev) == 1
    assert choose_num_splits(1, 1, 32768, dev) > 1
    assert choose_num_splits(1, 1, 32768, dev) >= choose_num_splits(64, 8, 32768, dev)
    assert choose_num_splits(256, 8, 32768, dev) == 1
    for batch in (1, 2, 5):
        for context in (300, 1000, 5000, 10**6):
            splits = choose_num_splits(batch, 2, context, dev)
            assert 1 <= splits <= max(1, min(context // 256, 64))


def test_decode_rejects_bad_arguments():
    case = _decode_case([8], 4, 2)
    with pytest.raises(ValueError, match="num_splits"):
        _check(case, 0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(case.query, case.k_cache, case.v_cache, case.block_tables,
                               case.seq_lens.repeat(2), 0.1)
