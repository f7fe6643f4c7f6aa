"""Bidirectional image spans (``AttentionMetadata.bidirectional``, Gemma 3): the torch backend
lets a query inside a span attend to every key of the span, later ones included, under
``(causal OR same span) AND window``; checked against a dense reference built from full K/V
and an explicit mask, on the whole-prompt path, the paged prefill path (chunks that start
mid-span after a prefix hit), beside decodes, with softcap, batch invariance and an int8 pool.
The Triton backend refuses spans."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kv_format.formats import dequantize_rows, kv_format, quantize_rows

BS, H, KVH, D = 4, 4, 2, 16
SCALE = 0.25


class _Seqs:
    """Sequences of known full q/k/v (indexed by position), paged into shuffled pool blocks."""

    def __init__(self, lengths: list[int], kind: str = "float32", seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.fmt = kv_format(kind, torch.float32, D)
        tables = [-(-n // BS) for n in lengths]
        num_blocks = sum(tables) + 3
        perm = torch.randperm(num_blocks, generator=g).tolist()
        self.tables, nxt = [], 0
        for nb in tables:
            self.tables.append(perm[nxt:nxt + nb])
            nxt += nb
        shape = (num_blocks, BS, KVH, self.fmt.row_width)
        self.k_cache = torch.zeros(shape, dtype=self.fmt.storage_dtype)
        self.v_cache = torch.zeros(shape, dtype=self.fmt.storage_dtype)
        self.q = [torch.randn(n, H, D, generator=g) for n in lengths]
        self.k = [torch.randn(n, KVH, D, generator=g) for n in lengths]
        self.v = [torch.randn(n, KVH, D, generator=g) for n in lengths]

    def slots(self, b: int, lo: int, hi: int) -> list[int]:
        return [self.tables[b][p // BS] * BS + p % BS for p in range(lo, hi)]

    def cache(self, b: int, upto: int) -> None:
        """Store keys/values ``0 .. upto - 1`` of sequence ``b`` (a prefix-cache hit)."""
        slots = torch.tensor(self.slots(b, 0, upto))
        kvh, w = self.k_cache.shape[-2:]
        self.k_cache.view(-1, kvh, w)[slots] = quantize_rows(self.k[b][:upto], self.fmt)
        self.v_cache.view(-1, kvh, w)[slots] = quantize_rows(self.v[b][:upto], self.fmt)

    def pooled(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s K/V as the pool returns them (rounded by its format)."""
        rt = [dequantize_rows(quantize_rows(x, self.fmt), self.fmt, torch.float32)
              for x in (self.k[b], self.v[b])]
        return rt[0], rt[1]

    def step(self, chunks: list[tuple[int, int, int]],
             spans: tuple[tuple[int, int, int], ...] = ()):
        """One step computing positions ``[start, end)`` of sequence ``b`` per ``(b, start,
        end)``, decodes first; ``spans`` as ``(b, first, end)`` with ``b`` this list's index
        -> (meta, q, k, v)."""
        q_lens = [e - s for _, s, e in chunks]
        seq_lens = [e for _, _, e in chunks]
        width = max(len(self.tables[b]) for b, _, _ in chunks)
        bt = torch.tensor([self.tables[b] + [0] * (width - len(self.tables[b]))
                           for b, _, _ in chunks], dtype=torch.int32)
        nd = 0
        while nd < len(q_lens) and q_lens[nd] == 1:
            nd += 1
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(sum((self.slots(b, s, e) for b, s, e in chunks), [])),
            cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
            block_size=BS, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            num_decodes=nd, num_decode_tokens=nd, query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens, all_slots_valid=True, bidirectional=spans)
        rows = [torch.cat([x[b][s:e] for b, s, e in chunks]) for x in (self.q, self.k, self.v)]
        return meta, *rows


def _dense(q, k, v, start: int, end: int, spans, window=None, softcap=None) -> torch.Tensor:
    """Reference rows ``start .. end - 1`` of one sequence over its keys ``0 .. end - 1``:
    plain softmax attention under mask ``(j <= p OR p, j in one span) AND j > p - window``."""
    p = torch.arange(start, end).unsqueeze(1)
    j = torch.arange(end).unsqueeze(0)
    mask = j <= p
    for first, last in spans:
        mask |= (p >= first) & (p < last) & (j >= first) & (j < last)
    if window is not None:
        mask &= j > p - window
    group = H // KVH
    kk = k[:end].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, end, D]
    vv = v[:end].repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q[start:end].transpose(0, 1) @ kk.transpose(1, 2) * SCALE  # [H, Lq, end]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ vv).transpose(0, 1)


def _run(backend, seqs: _Seqs, meta, q, k, v, window=None, softcap=None):
    backend.prepare(meta)
    return backend.forward(q, k, v, seqs.k_cache, seqs.v_cache, meta, SCALE, window,
                           softcap=softcap)


TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("spans", [[(3, 9)], [(2, 6), (8, 13)]], ids=["one", "two"])
def test_whole_prompt_spans_match_the_reference(spans, softcap):
    seqs = _Seqs([15])
    meta, q, k, v = seqs.step([(0, 0, 15)], tuple((0, f, e) for f, e in spans))
    got = _run(TorchAttentionBackend(), seqs, meta, q, k, v, softcap=softcap)
    want = _dense(seqs.q[0], seqs.k[0], seqs.v[0], 0, 15, spans, softcap=softcap)
    torch.testing.assert_close(got, want, **TOL)
    causal = _dense(seqs.q[0], seqs.k[0], seqs.v[0], 0, 15, [], softcap=softcap)
    assert not torch.allclose(got, causal, atol=1e-3)  # the spans do change the output


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_window_smaller_than_the_span_cuts_it(softcap):
    seqs = _Seqs([12])
    meta, q, k, v = seqs.step([(0, 0, 12)], ((0, 3, 9),))
    got = _run(TorchAttentionBackend(), seqs, meta, q, k, v, window=4, softcap=softcap)
    want = _dense(seqs.q[0], seqs.k[0], seqs.v[0], 0, 12, [(3, 9)], window=4, softcap=softcap)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize("window", [None, 4])
def test_a_chunk_starting_mid_span_after_a_prefix_hit(kind, window):
    """A first forward computes the whole prompt (its span in one step) into the pool; a
    second starts at position 6, inside span [3, 11), and reads keys 0 .. 5 from the pool."""
    seqs = _Seqs([14], kind)
    span = ((0, 3, 11),)
    backend = TorchAttentionBackend()
    meta, q, k, v = seqs.step([(0, 0, 14)], span)
    first = _run(backend, seqs, meta, q, k, v, window=window)
    exact = _dense(seqs.q[0], seqs.k[0], seqs.v[0], 0, 14, [(3, 11)], window)
    tol = TOL if kind == "float32" else {"atol": 5e-2, "rtol": 5e-2}
    torch.testing.assert_close(first, exact, **(TOL if window is None else tol))
    meta, q, k, v = seqs.step([(0, 6, 14)], span)
    got = _run(backend, seqs, meta, q, k, v, window=window)
    pk, pv = seqs.pooled(0)
    torch.testing.assert_close(got, _dense(seqs.q[0], pk, pv, 6, 14, [(3, 11)], window), **TOL)
    torch.testing.assert_close(got, first[6:], **tol)


def test_decodes_stay_in_the_decode_group_beside_span_prompts():
    """Sequence 0 decodes after its image (a span wholly before its query: causal covers it),
    sequence 1 is a short chunk after a prefix hit that ends an image (it would join the
    decode group without its span), sequence 2 a whole prompt with an image."""
    seqs = _Seqs([13, 16, 11])
    seqs.cache(0, 12)
    seqs.cache(1, 9)
    spans = ((0, 2, 8), (1, 5, 12), (2, 1, 7))
    meta, q, k, v = seqs.step([(0, 12, 13), (1, 9, 16), (2, 0, 11)], spans)
    backend = TorchAttentionBackend()
    got = _run(backend, seqs, meta, q, k, v)
    state = meta.backend_state
    assert state["decode"].num_rows == 1
    assert [p.token_start for p in state["prefills"]] == [1, 8]
    assert all(p.same_span is not None for p in state["prefills"])
    want = torch.cat([
        _dense(seqs.q[0], seqs.k[0], seqs.v[0], 12, 13, [(2, 8)]),
        _dense(seqs.q[1], seqs.k[1], seqs.v[1], 9, 16, [(5, 12)]),
        _dense(seqs.q[2], seqs.k[2], seqs.v[2], 0, 11, [(1, 7)])])
    torch.testing.assert_close(got, want, **TOL)


def test_spans_outside_the_step_queries_change_nothing():
    """A span wholly before the chunk, one after it and a one-token span: no mask of theirs,
    and the short chunk keeps the decode group."""
    seqs = _Seqs([30])
    seqs.cache(0, 10)
    meta, q, k, v = seqs.step([(0, 10, 20)], ((0, 2, 9), (0, 22, 28), (0, 12, 13)))
    got = _run(TorchAttentionBackend(), seqs, meta, q, k, v)
    assert meta.backend_state["decode"].num_rows == 10 and not meta.backend_state["prefills"]
    torch.testing.assert_close(got, _dense(seqs.q[0], seqs.k[0], seqs.v[0], 10, 20, []), **TOL)


def test_batch_invariant_group_stops_before_the_first_span_sequence():
    seqs = _Seqs([9, 12, 14, 7])
    seqs.cache(0, 8)
    seqs.cache(1, 6)
    meta, q, k, v = seqs.step([(0, 8, 9), (1, 6, 12), (2, 0, 14), (3, 0, 7)], ((2, 4, 10),))
    backend = TorchAttentionBackend()
    backend.batch_invariant = True
    got = _run(backend, seqs, meta, q, k, v, softcap=5.0)
    assert meta.backend_state["decode"].num_rows == 1 + 6
    assert [p.token_start for p in meta.backend_state["prefills"]] == [7, 21]
    want = torch.cat([
        _dense(seqs.q[0], seqs.k[0], seqs.v[0], 8, 9, [], softcap=5.0),
        _dense(seqs.q[1], seqs.k[1], seqs.v[1], 6, 12, [], softcap=5.0),
        _dense(seqs.q[2], seqs.k[2], seqs.v[2], 0, 14, [(4, 10)], softcap=5.0),
        _dense(seqs.q[3], seqs.k[3], seqs.v[3], 0, 7, [], softcap=5.0)])
    torch.testing.assert_close(got, want, **TOL)


def test_a_span_split_across_steps_is_refused():
    seqs = _Seqs([14])
    meta, *_ = seqs.step([(0, 0, 8)], ((0, 3, 11),))
    with pytest.raises(ValueError, match="must not be split"):
        TorchAttentionBackend().prepare(meta)


def test_triton_backend_refuses_spans():
    triton_backend = pytest.importorskip("engine.attention.triton_backend")
    seqs = _Seqs([12])
    meta, q, k, v = seqs.step([(0, 0, 12)], ((0, 3, 9),))
    backend = triton_backend.TritonAttentionBackend()
    with pytest.raises(NotImplementedError, match="need the torch attention backend"):
        backend.prepare(meta)
    with pytest.raises(NotImplementedError, match="need the torch attention backend"):
        backend.forward(q, k, v, seqs.k_cache, seqs.v_cache, meta, SCALE, None)
