"""TritonAttentionBackend (store, then decode kernel for leading decodes and prefill kernel
for the rest) against the reference store + attention over the whole mixed batch."""

from __future__ import annotations

import pytest
import torch

from engine.kv_format.formats import dequantize_rows, kv_format, quantize_rows
from tests.kernels.conftest import DEVICE, make_block_tables

pytest.importorskip("triton")
from engine.attention.backend import get_attention_backend  # noqa: E402
from engine.attention.metadata import AttentionMetadata  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvserve_kernels import reference as ref  # noqa: E402

BS, KVH, H, D = 8, 2, 6, 64


def _step(seq_lens, q_lens, num_decodes, pad_tokens=0, seed=0):
    """A step's metadata and inputs; ``pad_tokens`` trailing tokens of the last sequence get
    slot -1 (e.g. padding a graph-captured batch) and must not be stored."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BS) for s in seq_lens) + 4
    tables = make_block_tables(seq_lens, BS, num_blocks, g)
    slots = []
    for b, (s, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pos = torch.arange(s - q, s)
        slots.append(tables[b].cpu()[pos // BS].long() * BS + pos % BS)
    slot_mapping = torch.cat(slots)
    if pad_tokens:
        slot_mapping[-pad_tokens:] = -1
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(DEVICE), cu_seqlens_q=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=tables,
        block_size=BS, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decodes=num_decodes, num_decode_tokens=num_decodes, query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens))
    t = sum(q_lens)
    qkv = torch.randn(t, H + 2 * KVH, D, generator=g).to(DEVICE)
    q, k, v = qkv.split([H, KVH, KVH], dim=1)  # strided views, as the model passes them
    pools = [torch.randn(num_blocks, BS, KVH, D, generator=g).to(DEVICE) for _ in range(2)]
    return meta, q, k, v, pools


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seq_lens,q_lens,num_decodes,pad", [
    ([17, 1, 40, 9], [1, 1, 12, 9], 2, 0),  # decodes, a chunk over cached context, a prompt
    ([30, 5], [1, 1], 2, 0),  # decodes only
    ([16, 23], [16, 3], 0, 2),  # prefills only, with padding slots
])
def test_backend_matches_reference(seq_lens, q_lens, num_decodes, pad, window):
    meta, q, k, v, (k_cache, v_cache) = _step(seq_lens, q_lens, num_decodes, pad)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    backend = TritonAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, window)

    ref.store_kv(k, v, k_ref, v_ref, meta.slot_mapping)
    expect = ref.paged_attention(q, k_ref, v_ref, meta.block_tables, meta.cu_seqlens_q,
                                 meta.seq_lens, 0.125, window)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert out.shape == q.shape
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("smoothed", [False, True])
def test_backend_over_an_int4_pool_works_in_the_rotated_basis(smoothed):
    """An int4 pool holds ``quantize_rows``' bytes (K and V rotated before the store, as the
    PyTorch backend stores them), and the output is attention over the pool's
    ``dequantize_rows`` (queries rotated in, output rotated back); with a calibrated key
    smoothing ``s`` the pool holds ``K / s`` and the queries are multiplied by ``s``."""
    meta, q, k, v, pools = _step([17, 1, 40, 9], [1, 1, 12, 9], 2)
    s = (torch.rand(KVH, D, generator=torch.Generator().manual_seed(5)) + 0.5) if smoothed \
        else None
    fmt = kv_format("int4", torch.float32, D)
    k_cache, v_cache = (quantize_rows(p * 2, fmt) for p in pools)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    backend = TritonAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.125, None,
                          kv_scales=None if s is None else (s, None))

    keep = meta.slot_mapping
    k_ref.view(-1, KVH, fmt.row_width)[keep] = quantize_rows(k, fmt, s)
    v_ref.view(-1, KVH, fmt.row_width)[keep] = quantize_rows(v, fmt)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    expect = ref.paged_attention(
        q, dequantize_rows(k_ref, fmt, torch.float32, s), dequantize_rows(v_ref, fmt, torch.float32),
        meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 0.125, None)
    torch.testing.assert_close(out, expect, atol=5e-5, rtol=5e-5)


def test_registry_returns_the_triton_backend():
    backend = get_attention_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
