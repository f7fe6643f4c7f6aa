"""The compiled CPU paged-decode kernel against the PyTorch reference in kvserve_kernels/reference.py."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.kernels import load
from kvserve_kernels.reference import paged_decode_attention


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


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 24])  # the vector path, and the portable loop
@pytest.mark.parametrize("window", [None, 5])
def test_quantised_pool_matches_reference_on_dequantised(kernel, kind, heads, kv_heads,
                                                         head_dim, window):
    """Over an 8-bit pool (engine/kv_format/formats.py) the kernel computes exactly the float
    reference over that pool dequantised: the scales are folded in, not approximated."""
    from engine.kv_format.formats import (
        byte_view,
        dequantize_rows,
        fp8_table,
        kv_format,
        quantize_rows,
    )

    gen = torch.Generator().manual_seed(heads + head_dim + (window or 0))
    block_size, num_blocks = 16, 24
    seq_lens = torch.tensor([1, 16, 17, 40], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[:12].view(4, 3).to(torch.int32)
    fmt = kv_format(kind, torch.float32, head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen) * 3
    v = torch.randn(shape, generator=gen)
    q = torch.randn(4, heads, head_dim, generator=gen)
    ks = vs = None
    if fmt.kind == "fp8":
        ks = torch.linspace(0.02, 0.05, kv_heads)
        vs = torch.linspace(0.01, 0.03, kv_heads)
    kq, vq = quantize_rows(k, fmt, ks), quantize_rows(v, fmt, vs)
    ref = paged_decode_attention(q, dequantize_rows(kq, fmt, torch.float32, ks),
                                 dequantize_rows(vq, fmt, torch.float32, vs), tables, seq_lens,
                                 0.125, sliding_window=window)
    if fmt.kind == "int8":
        got = kernel.paged_decode_cpu_int8(q, kq, vq, tables, seq_lens, 0.125, window or 0)
    else:
        got = kernel.paged_decode_cpu_fp8(q, byte_view(kq), byte_view(vq), tables, seq_lens,
                                          0.125, window or 0, fp8_table(fmt.storage_dtype),
                                          ks, vs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 24])  # the vector path, and the portable loop
@pytest.mark.parametrize("window", [None, 5])
def test_16bit_pool_matches_reference_on_widened(kernel, dtype, heads, kv_heads, head_dim,
                                                 window):
    """Over a float16 / bfloat16 pool (kv_cache_dtype float16 / bfloat16) under float32
    queries the kernel computes the float32 reference over that pool widened: exact widening,
    float32 math."""
    gen = torch.Generator().manual_seed(7 * heads + head_dim + (window or 0))
    block_size, num_blocks = 16, 24
    seq_lens = torch.tensor([1, 16, 17, 40, 9], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[:15].view(5, 3).to(torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = (torch.randn(shape, generator=gen) * 3).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(5, heads, head_dim, generator=gen)
    ref = paged_decode_attention(q, k.float(), v.float(), tables, seq_lens, 0.125,
                                 sliding_window=window)
    got = kernel.paged_decode_cpu(q, k, v, tables, seq_lens, 0.125, window or 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_pools_of_two_dtypes_or_an_unknown_dtype_are_refused(kernel):
    k = torch.zeros(2, 4, 1, 16, dtype=torch.float16)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.25, 0)
    q = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.paged_decode_cpu(q, k, k.float(), *args)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        kernel.paged_decode_cpu(q, k.double(), k.double(), *args)


def _int4_case(heads, kv_heads, head_dim, window, seed):
    """A shuffled int4 pool over ragged lengths across block boundaries, and its query."""
    from engine.kv_format.formats import kv_format, quantize_rows

    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 16, 24
    seq_lens = torch.tensor([1, 16, 17, 40, 9], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[:15].view(5, 3).to(torch.int32)
    fmt = kv_format("int4", torch.float32, head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen) * 3
    k[..., 5] *= 20  # an outlier channel, as real keys have
    v = torch.randn(shape, generator=gen)
    q = torch.randn(5, heads, head_dim, generator=gen)
    return fmt, quantize_rows(k, fmt), quantize_rows(v, fmt), q, tables, seq_lens


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 24])  # the vector path, and the portable loop
@pytest.mark.parametrize("window", [None, 5])
def test_int4_pool_matches_reference_on_plain_dequantised(kernel, heads, kv_heads, head_dim,
                                                          window):
    """Over an int4 pool the kernel computes the float reference over the rows as stored
    (``dequantize_int4_plain``: the rotated values; the kernel itself rotates nothing)."""
    from engine.kv_format.formats import dequantize_int4_plain

    fmt, kq, vq, q, tables, seq_lens = _int4_case(heads, kv_heads, head_dim, window,
                                                  heads + head_dim + (window or 0))
    ref = paged_decode_attention(q, dequantize_int4_plain(kq, head_dim),
                                 dequantize_int4_plain(vq, head_dim), tables, seq_lens, 0.125,
                                 sliding_window=window)
    got = kernel.paged_decode_cpu_int4(q, kq, vq, tables, seq_lens, 0.125, window or 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_int4_pool_whole_contract_rotates_back(kernel):
    """The backend's use (torch_backend._cpu_decode): the query rotated in and the output
    rotated back give attention over the pool dequantised to the original basis."""
    from engine.kv_format.formats import dequantize_rows, int4_rotate

    fmt, kq, vq, q, tables, seq_lens = _int4_case(9, 3, 64, None, 11)
    ref = paged_decode_attention(q, dequantize_rows(kq, fmt, torch.float32),
                                 dequantize_rows(vq, fmt, torch.float32), tables, seq_lens, 0.125)
    got = int4_rotate(kernel.paged_decode_cpu_int4(int4_rotate(q), kq, vq, tables, seq_lens,
                                                   0.125, 0))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_int4_pool_of_the_wrong_width_is_refused(kernel):
    rows = torch.zeros(2, 4, 1, 40, dtype=torch.uint8)  # head_dim 64 needs 36 bytes
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="pool rows of 40 bytes"):
        kernel.paged_decode_cpu_int4(q, rows, rows, torch.zeros(1, 1, dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32), 0.125, 0)


def _prompt_rows_case(dtype_kind, heads, kv_heads, head_dim, window, seed):
    """Rows as batch-invariant serving sends them: a decode row, then 19 consecutive rows of one
    prompt after 5 cached keys (more than one group of 8), then 3 rows of another sequence. The
    pool is float32, float16, int8, int4 or fp8 (the last three quantised from float keys)."""
    from engine.kv_format.formats import byte_view, kv_format, quantize_rows

    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks = 4, 40
    lens = [11] + [5 + j + 1 for j in range(19)] + [2, 3, 4]
    seqs = [0] + [1] * 19 + [2] * 3
    tables = torch.randperm(num_blocks, generator=gen)[:18].view(3, 6).to(torch.int32)
    tables = tables[torch.tensor(seqs)].contiguous()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen) * 3
    v = torch.randn(shape, generator=gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if dtype_kind in ("float32", "float16"):
        dt = getattr(torch, dtype_kind)
        return q, k.to(dt), v.to(dt), tables, seq_lens, lambda kern, *a, **kw: kern.paged_decode_cpu(*a, **kw)
    fmt = kv_format(dtype_kind, torch.float32, head_dim)
    if fmt.kind in ("int8", "int4"):  # paged_decode_cpu_int8 / _int4
        name = f"paged_decode_cpu_{fmt.kind}"
        return (q, quantize_rows(k, fmt), quantize_rows(v, fmt), tables, seq_lens,
                lambda kern, *a, **kw: getattr(kern, name)(*a, **kw))
    from engine.kv_format.formats import fp8_table

    ks, vs = torch.linspace(0.02, 0.05, kv_heads), torch.linspace(0.01, 0.03, kv_heads)
    table = fp8_table(fmt.storage_dtype)
    return (q, byte_view(quantize_rows(k, fmt, ks)), byte_view(quantize_rows(v, fmt, vs)),
            tables, seq_lens, lambda kern, *a, **kw: kern.paged_decode_cpu_fp8(*a, table, ks, vs,
                                                                    **kw))


@pytest.mark.parametrize("kind", ["float32", "float16", "int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (9, 3, 64), (8, 2, 48),
                                                     (2, 1, 24)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_prompt_rows_together_equal_rows_alone(kernel, kind, heads, kv_heads, head_dim, window,
                                               softcap):
    """Consecutive rows of one prompt share their K/V reads in one task (groups of up to 8);
    each row's output is bit for bit what the row gives alone in a call of its own, so the
    grouping cannot make serving depend on the batch (and what a row gives alone matches the
    float reference on the same pool in test_matches_reference and the tests above); with
    soft-capped scores (Gemma 2) too."""
    q, k, v, tables, seq_lens, call = _prompt_rows_case(kind, heads, kv_heads, head_dim, window,
                                                       seed=heads + head_dim)
    together = call(kernel, q, k, v, tables, seq_lens, 0.125, window or 0, softcap=softcap)
    for b in range(len(seq_lens)):
        alone = call(kernel, q[b:b + 1], k, v, tables[b:b + 1], seq_lens[b:b + 1], 0.125,
                     window or 0, softcap=softcap)
        assert torch.equal(together[b:b + 1].view(torch.int32), alone.view(torch.int32)), b


@pytest.mark.parametrize("kind", ["float32", "int4"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (8, 2, 48), (9, 3, 64)])
@pytest.mark.parametrize("window", [None, 5])
def test_prompt_rows_match_reference(kernel, kind, heads, kv_heads, head_dim, window):
    """The grouped rows (wide heads, a head_dim that is not a multiple of the widest register
    tile) against the PyTorch reference over the same pool: float32, or int4 as
    ``dequantize_int4_plain`` reads it (the rows as stored; the kernel rotates nothing)."""
    from engine.kv_format.formats import dequantize_int4_plain

    q, k, v, tables, seq_lens, call = _prompt_rows_case(kind, heads, kv_heads, head_dim,
                                                        window, seed=3)
    kf, vf = (k, v) if kind == "float32" else (dequantize_int4_plain(k, head_dim),
                                               dequantize_int4_plain(v, head_dim))
    ref = paged_decode_attention(q, kf, vf, tables, seq_lens, 0.125, sliding_window=window)
    got = call(kernel, q, k, v, tables, seq_lens, 0.125, window or 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "float16", "int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (9, 3, 64), (2, 1, 24)])
@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_scores_match_reference(kernel, kind, heads, kv_heads, head_dim, window):
    """Gemma 2's soft-capped scores (``cap * tanh(s / cap)`` before the softmax) on the vector
    path and the portable loop (head_dim 24), decode rows and grouped prompt rows, every pool
    format: the reference over the same pool dequantised, capped in float32."""
    from engine.kv_format.formats import dequantize_int4_plain, dequantize_rows, kv_format

    q, k, v, tables, seq_lens, call = _prompt_rows_case(kind, heads, kv_heads, head_dim,
                                                        window, seed=11)
    q = q * 4  # scores of several units: the cap of 2 bends most of them
    if kind.startswith("fp8"):
        fmt = kv_format(kind, torch.float32, head_dim)
        ks, vs = torch.linspace(0.02, 0.05, kv_heads), torch.linspace(0.01, 0.03, kv_heads)
        kf = dequantize_rows(k.view(fmt.storage_dtype), fmt, torch.float32, ks)
        vf = dequantize_rows(v.view(fmt.storage_dtype), fmt, torch.float32, vs)
    elif kind == "int8":
        fmt = kv_format(kind, torch.float32, head_dim)
        kf, vf = (dequantize_rows(x, fmt, torch.float32) for x in (k, v))
    elif kind == "int4":
        kf, vf = (dequantize_int4_plain(x, head_dim) for x in (k, v))
    else:
        kf, vf = k.float(), v.float()
    ref = paged_decode_attention(q, kf, vf, tables, seq_lens, 0.125, sliding_window=window,
                                 softcap=2.0)
    got = call(kernel, q, k, v, tables, seq_lens, 0.125, window or 0, softcap=2.0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5)
    uncapped = call(kernel, q, k, v, tables, seq_lens, 0.125, window or 0)
    assert (uncapped - got).abs().max() > 0.05  # the cap changed the answer
