"""Prompt logprobs reduced chunk by chunk: identical to the one-piece computation, and never
more than a chunk of logits rows alive at once."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.prompt_logprobs import (
    position_entries,
    prompt_logprobs_in_chunks,
    reduce_logits,
)


def test_chunks_equal_one_piece_and_bound_the_rows():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 8, generator=g)
    head = torch.randn(30, 8, generator=g)
    rows = torch.tensor([1, 2, 3, 10, 11, 12, 13, 14, 40, 41, 42])
    targets = torch.randint(0, 30, (len(rows),), generator=g)
    seen = []

    def compute_logits(h):
        seen.append(h.shape[0])
        return h @ head.T

    got = prompt_logprobs_in_chunks(compute_logits, hidden, rows, targets, k=3, chunk=4)
    assert seen == [4, 4, 3]
    entries = position_entries(got, 0, len(rows), targets.tolist(), 3, token_text=str)
    one_piece = reduce_logits(hidden[rows] @ head.T, targets, 3)
    want = position_entries(one_piece, 0, len(rows), targets.tolist(), 3, token_text=str)
    assert len(entries) == len(want)
    for e, w in zip(entries, want, strict=True):
        assert e.keys() == w.keys()
        for t in e:
            assert e[t].rank == w[t].rank and e[t].decoded_token == w[t].decoded_token
            assert e[t].logprob == pytest.approx(w[t].logprob, abs=1e-6)
    # A request asking for fewer alternatives than the step's largest k gets its own k.
    assert all(len(e) <= 2 for e in position_entries(got, 2, 5, targets[2:5].tolist(), 1))


def test_no_rows_gives_an_empty_result():
    got = prompt_logprobs_in_chunks(lambda h: h, torch.zeros(3, 4), torch.zeros(0).long(),
                                    torch.zeros(0).long(), k=2)
    assert got.num_rows == 0
    with pytest.raises(ValueError, match="chunk"):
        prompt_logprobs_in_chunks(lambda h: h, torch.zeros(3, 4), torch.zeros(1).long(),
                                  torch.zeros(1).long(), k=2, chunk=0)
