"""int4 KV pools in the Triton kernels against the PyTorch format (engine/kv_format/formats.py).

The kernels work in the rotated basis: ``store_kv`` packs rows it is given already rotated, and
the attention kernels read the pool as plain 4-bit rows (``dequantize_int4_plain``). So:
``store_kv`` must write exactly the bytes of ``_quantize_int4`` on the same input (ties of
equal magnitude, zero groups and exact half-steps included); decode and prefill over a pool
must equal the float reference kernels over that pool's ``dequantize_int4_plain``; block moves
are byte copies. The rotation itself (backend side) is checked by the engine test
(tests/kernels/test_engine_triton.py) and the format's own tests.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_format.formats import _quantize_int4, dequantize_int4_plain, int4_row_width
from tests.kernels.conftest import DEVICE, make_paged_case

pytest.importorskip("triton")
from kvserve_kernels import reference as ref  # noqa: E402
from kvserve_kernels.copy_blocks import copy_blocks, copy_blocks_triton  # noqa: E402
from kvserve_kernels.paged_attention import paged_attention  # noqa: E402
from kvserve_kernels.paged_decode import paged_decode_attention  # noqa: E402
from kvserve_kernels.store_kv import store_kv  # noqa: E402


def _pools(case, head_dim):
    """The case's float pools (x3, so codes span the range) as int4 pools, and what they hold."""
    kq = _quantize_int4(case.k_cache.float() * 3, head_dim)
    vq = _quantize_int4(case.v_cache.float() * 3, head_dim)
    return kq, vq, dequantize_int4_plain(kq, head_dim), dequantize_int4_plain(vq, head_dim)


# 64: two groups of 32; 40: one group of the whole row (not a power of two, masked lanes).
@pytest.mark.parametrize("head_dim", [64, 40])
def test_store_kv_packs_bit_exact(head_dim):
    g = torch.Generator().manual_seed(1)
    kvh, nb, bs, width = 3, 6, 4, int4_row_width(head_dim)
    key = torch.randn(9, kvh, head_dim, generator=g) * 4
    value = torch.randn(9, kvh, head_dim, generator=g)
    key[2, 1] = 0.0
    key[2, 1, 0] = -0.0  # a zero group led by -0.0: the scale's sign bit must match too
    key[4, 0, 3], key[4, 0, 25] = 50.0, -50.0  # equal magnitudes: the first one sets the sign
    key[5, 2, 30], key[5, 2, 7] = -50.0, 50.0
    # Scales that are powers of two and codes on half-steps: every rounding is an exact tie.
    s = torch.tensor([[0.25], [1.0], [4.0]])
    value[6] = s * (torch.randint(-8, 8, (kvh, head_dim), generator=g) + 0.5)
    value[6, :, 1] = -8 * s[:, 0]  # the group's extreme: scale = s exactly
    value[7] = value[7] * 1e-6  # tiny scales (float16 subnormals)
    slots = torch.tensor([0, 5, 9, -1, 13, 22, 23, 2, 17], dtype=torch.int64)
    k_cache = torch.zeros(nb, bs, kvh, width, dtype=torch.uint8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    keep = slots >= 0
    for cache, x in ((k_cache, key), (v_cache, value)):
        rows = cache.view(-1, kvh, width).cpu()
        assert torch.equal(rows[slots[keep]], _quantize_int4(x[keep], head_dim))
        untouched = torch.ones(nb * bs, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert not rows[untouched].any()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_an_int4_pool(num_splits):
    # GQA 3:1, ragged lengths across block boundaries, with and without a window.
    d = 64
    case = make_paged_case([1, 8, 45], [1] * 3, 6, 2, d, 8, seed=0)
    kq, vq, k_deq, v_deq = _pools(case, d)
    for window in (None, 13):
        out = paged_decode_attention(case.query, kq, vq, case.block_tables, case.seq_lens,
                                     0.125, num_splits, sliding_window=window)
        expect = ref.paged_decode_attention(case.query, k_deq, v_deq, case.block_tables,
                                            case.seq_lens, 0.125, sliding_window=window)
        torch.testing.assert_close(out, expect, atol=5e-5, rtol=5e-5)


# Blocks of 8 (a key tile spans pages) and of 32 (a key tile inside one page).
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (40, 32)])
def test_prefill_over_an_int4_pool(head_dim, block_size):
    # Chunks after cached context (block boundaries crossed), a whole prompt, and a window.
    case = make_paged_case([20, 9], [5, 9], 6, 2, head_dim, block_size, seed=3)
    kq, vq, k_deq, v_deq = _pools(case, head_dim)
    for window in (None, 6):
        out = paged_attention(case.query, kq, vq, case.block_tables, case.cu_seqlens_q,
                              case.seq_lens, 0.125, window)
        expect = ref.paged_attention(case.query, k_deq, v_deq, case.block_tables,
                                     case.cu_seqlens_q, case.seq_lens, 0.125, window)
        torch.testing.assert_close(out, expect, atol=5e-5, rtol=5e-5)


def test_copy_blocks_moves_int4_rows_bit_exact():
    x = torch.randn(4, 8, 2, 32, generator=torch.Generator().manual_seed(2))
    pool = _quantize_int4(x, 32).to(DEVICE)
    mapping = torch.tensor([[0, 3], [2, 1]], dtype=torch.int64)
    for copy in (copy_blocks, lambda s, d, m: copy_blocks_triton([s], [d], m)):
        other = torch.zeros_like(pool)
        copy(pool, other, mapping)
        assert torch.equal(other[3], pool[0]) and torch.equal(other[1], pool[2])
    host = torch.zeros_like(pool, device="cpu")
    copy_blocks(pool, host, torch.tensor([[1, 0]], dtype=torch.int64))
    assert torch.equal(host[0], pool[1].cpu())
