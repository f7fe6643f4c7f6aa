"""The reference kernels against independent computations: dense SDPA on contiguous K/V with
an explicitly built causal (and sliding-window) mask, and per-token / per-block loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve_kernels import reference as ref


def _dense_mask(q_len: int, seq_len: int, window: int | None) -> torch.Tensor:
    # Built from triangular matrices, not from positions, to stay independent of the reference.
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
    if window is not None:
        mask &= ~torch.ones(q_len, seq_len, dtype=torch.bool).tril(
            diagonal=seq_len - q_len - window)
    return mask


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_attention_matches_dense_sdpa(window, heads, kv_heads, block_size):
    g = torch.Generator().manual_seed(1)
    seq_lens, q_lens, dim = [1, 16, 23, 9], [1, 16, 4, 1], 32
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    slots_free = torch.randperm(num_blocks, generator=g).tolist()
    tables, dense_k, dense_v = [], [], []
    for s in seq_lens:
        n = -(-s // block_size)
        blocks, slots_free = slots_free[:n], slots_free[n:]
        tables.append(blocks + [0] * (8 - n))
        keys = torch.randn(s, kv_heads, dim, generator=g)
        vals = torch.randn(s, kv_heads, dim, generator=g)
        pos = torch.arange(s)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        ref.store_kv(keys, vals, k_cache, v_cache, slots)
        dense_k.append(keys)
        dense_v.append(vals)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, dim, generator=g)
    out = ref.paged_attention(query, k_cache, v_cache, block_tables, cu,
                              torch.tensor(seq_lens, dtype=torch.int32), 0.3, window)
    for b, (s, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        q = query[cu[b]:cu[b + 1]].transpose(0, 1)  # [H, q_len, D]
        expect = F.scaled_dot_product_attention(
            q, dense_k[b].transpose(0, 1), dense_v[b].transpose(0, 1),
            attn_mask=_dense_mask(q_len, s, window), scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], expect.transpose(0, 1),
                                   atol=1e-5, rtol=1e-5)


def test_reference_decode_is_attention_of_the_last_token():
    g = torch.Generator().manual_seed(2)
    k_cache = torch.randn(6, 8, 2, 16, generator=g)
    v_cache = torch.randn(6, 8, 2, 16, generator=g)
    tables = torch.tensor([[3, 1], [5, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([13, 8], dtype=torch.int32)
    query = torch.randn(2, 4, 16, generator=g)
    out = ref.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.25)
    for b, s in enumerate(seq_lens.tolist()):
        keys = torch.cat([k_cache[i] for i in tables[b].tolist()])[:s]  # [s, KVH, D]
        vals = torch.cat([v_cache[i] for i in tables[b].tolist()])[:s]
        expect = F.scaled_dot_product_attention(
            query[b][:, None], keys.transpose(0, 1), vals.transpose(0, 1), scale=0.25,
            enable_gqa=True)
        torch.testing.assert_close(out[b], expect[:, 0], atol=1e-5, rtol=1e-5)


def test_reference_store_kv_writes_slots_and_skips_minus_one():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    slots = torch.tensor([9, -1, 0, 6])
    ref.store_kv(key, value, k_cache, v_cache, slots)
    written = {9: 0, 0: 2, 6: 3}
    for slot in range(12):
        blk, off = divmod(slot, 4)
        if slot in written:
            assert torch.equal(k_cache[blk, off], key[written[slot]])
            assert torch.equal(v_cache[blk, off], value[written[slot]])
        else:
            assert not k_cache[blk, off].any() and not v_cache[blk, off].any()


def test_reference_copy_blocks_reads_all_sources_before_writing():
    pool = torch.arange(4 * 3, dtype=torch.float32).view(4, 3)
    before = pool.clone()
    # Swap blocks 0 and 1, copy 2 -> 3: a sequential copy would read an overwritten block.
    ref.copy_blocks(pool, pool, torch.tensor([[0, 1], [1, 0], [2, 3]]))
    assert torch.equal(pool, before[[1, 0, 2, 2]])
