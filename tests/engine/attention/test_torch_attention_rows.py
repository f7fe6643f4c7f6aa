"""The torch backend's decode group runs short query chunks (speculative verification: 1 + k
rows) row by row: every row must equal the reference's causal attention, in a batch that
mixes decodes, short chunks and long chunks, through the compiled CPU kernel (float32) and the
SDPA fallback (bfloat16), with and without a sliding window."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import SMALL_QUERY_ROWS, TorchAttentionBackend
from kvserve_kernels import reference

BS, H, KVH, D = 4, 4, 2, 16


def _batch(dtype: torch.dtype):
    """(q_len, seq_len) per sequence, decodes first, as the scheduler orders them."""
    shapes = [(1, 9), (1, 30), (3, 12), (5, 5 + 17), (SMALL_QUERY_ROWS, 40), (20, 27), (7, 7)]
    g = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, nxt = [], [], 0
    for q, s in shapes:
        nb = -(-s // BS)
        tables.append(perm[nxt:nxt + nb])
        nxt += nb
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(s - q, s)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q_lens = [q for q, _ in shapes]
    seq_lens = [s for _, s in shapes]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    t = sum(q_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt, block_size=BS,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_decodes=2,
        num_decode_tokens=2, query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
        all_slots_valid=True)
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k = torch.randn(t, KVH, D, generator=g).to(dtype)
    v = torch.randn(t, KVH, D, generator=g).to(dtype)
    return meta, q, k, v, k_cache, v_cache


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 6])
def test_short_chunks_row_by_row_match_the_reference(dtype, tol, window):
    meta, q, k, v, k_cache, v_cache = _batch(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    want = reference.paged_attention(q, ref_k, ref_v, meta.block_tables, meta.cu_seqlens_q,
                                     meta.seq_lens, 0.25, sliding_window=window)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    group = meta.backend_state["decode"]
    assert group.num_rows == 1 + 1 + 3 + 5 + SMALL_QUERY_ROWS  # up to the first long chunk
    got = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_a_verification_row_equals_a_later_one_token_decode():
    """Row j of a 1 + k chunk computes bit for bit what a decode at that position computes
    (the same kernel over the same keys): the basis of greedy identity."""
    meta, q, k, v, k_cache, v_cache = _batch(torch.float32)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25, None)
    row = 2 + 1  # the second row of the 3-row chunk (sequence 2), at position 10
    pos = meta.seq_lens_cpu[2] - 3 + 1
    one = AttentionMetadata(
        slot_mapping=meta.slot_mapping[row:row + 1], cu_seqlens_q=torch.tensor([0, 1]),
        seq_lens=torch.tensor([pos + 1], dtype=torch.int32), block_tables=meta.block_tables[2:3],
        block_size=BS, max_query_len=1, max_seq_len=pos + 1, num_decodes=1,
        num_decode_tokens=1, query_lens_cpu=[1], seq_lens_cpu=[pos + 1], all_slots_valid=True)
    backend.prepare(one)
    single = backend.forward(q[row:row + 1], k[row:row + 1], v[row:row + 1], k_cache, v_cache,
                             one, 0.25, None)
    assert torch.equal(single[0], out[row])
