"""engine.sampling.argmax.first_argmax: both CPU paths, the C++ kernel (``first_argmax_rows``,
taken where the CPU kernels are built) and the two passes of PyTorch ops (taken without them),
return ``argmax``'s index (the first maximal one) in every case the single pass would: ties
within and across chunks and the kernel's segments and lanes, a maximum only in a ragged tail,
NaN, all -inf rows (a grammar's mask), strided input."""

from __future__ import annotations

import pytest
import torch

import engine.sampling.argmax as argmax_module
from engine.sampling.argmax import CHUNK, chunk_length, first_argmax, two_passes_pay


@pytest.fixture(autouse=True, params=["kernel", "two passes"])
def path(request, monkeypatch):
    """Each path at every shape here: the kernel where it is built; the two passes whatever
    this machine's threads and PyTorch build (the rule that picks them is tested on its own
    below)."""
    if request.param == "kernel":
        if argmax_module._kernel() is None:
            pytest.skip("the CPU kernels are not built here")
    else:
        monkeypatch.setattr(argmax_module, "_kernel", lambda: None)
        monkeypatch.setattr(argmax_module, "two_passes_pay", lambda *_: True)
    return request.param


def _check(x: torch.Tensor) -> None:
    assert torch.equal(first_argmax(x), x.argmax(dim=-1)), x.shape


@pytest.mark.parametrize("width", [64 * CHUNK, 64 * CHUNK + 1, 49_152 + 17, 262_144])
def test_random_rows_equal_argmax(width):
    g = torch.Generator().manual_seed(width)
    _check(torch.randn(3, width, generator=g))


def test_ties_within_and_across_chunks_pick_the_first():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randint(0, 3, (4, 70 * CHUNK + 300), generator=g).float()  # ties everywhere
        _check(x)
    x = torch.zeros(2, 80 * CHUNK + 5)
    x[0, [5 * CHUNK + 3, 2 * CHUNK + 9, 70 * CHUNK]] = 7.0  # first occurrence in chunk 2
    x[1, [CHUNK - 1, CHUNK]] = 7.0  # on both sides of a chunk border
    _check(x)
    assert first_argmax(x).tolist() == [2 * CHUNK + 9, CHUNK - 1]


def test_maximum_only_in_the_tail_and_tied_with_the_tail():
    width = 64 * CHUNK + 10
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(1))
    x[0, -1] = 50.0  # only in the tail
    x[1, 3] = x[1, -2] = 50.0  # in the body and the tail: the body's comes first
    _check(x)
    assert first_argmax(x)[:2].tolist() == [width - 1, 3]


def test_nan_and_minus_inf_rows_as_max():
    x = torch.randn(3, 64 * CHUNK + 3, generator=torch.Generator().manual_seed(2))
    x[0, 10] = float("nan")
    x[1] = float("-inf")  # every token masked
    x[2, 99] = float("inf")
    assert torch.equal(first_argmax(x), x.max(dim=-1).indices)
    assert first_argmax(x[1:]).tolist() == [0, 99]


@pytest.mark.parametrize("width", [1, 7, 31, 32, 33, 1000, 32_767, 32_768, 32_769, 65_537])
def test_short_and_ragged_rows_and_segment_borders(width, path, monkeypatch):
    if path == "two passes" and width < CHUNK:  # shorter than a chunk: the rule's single pass
        monkeypatch.setattr(argmax_module, "two_passes_pay", two_passes_pay)
    g = torch.Generator().manual_seed(width)
    _check(torch.randn(5, width, generator=g))
    _check(torch.randint(-3, 3, (17, width), generator=g).float())  # ties everywhere
    x = torch.zeros(2, width)
    x[:, : width // 2] = -0.0  # -0.0 and 0.0 are equal: the first zero wins
    _check(x)


def test_ties_across_kernel_segments_and_lanes():
    x = torch.zeros(3, 3 * 32_768 + 40)
    x[0, [2 * 32_768 + 5, 32_768 + 31, 32_768 + 1]] = 9.0  # the same segment, lanes apart
    x[1, [32_767, 32_768]] = 9.0  # on both sides of a segment border
    x[2, [3 * 32_768 + 39, 3 * 32_768 + 3]] = 9.0  # only in the last, short segment
    _check(x)
    assert first_argmax(x).tolist() == [32_768 + 1, 32_767, 3 * 32_768 + 3]


def test_nan_in_a_later_segment_and_in_the_tail():
    x = torch.randn(3, 2 * 32_768 + 7, generator=torch.Generator().manual_seed(4))
    x[0, [40_000, 50_000]] = float("nan")
    x[0, 5] = float("inf")
    x[1, -1] = float("nan")
    assert first_argmax(x).tolist() == [40_000, 2 * 32_768 + 6, int(x[2].argmax())]
    assert torch.equal(first_argmax(x), x.max(dim=-1).indices)


def test_strided_rows():
    big = torch.randn(4, 2 * (70 * CHUNK), generator=torch.Generator().manual_seed(3))
    _check(big[:, ::2])  # not contiguous
    _check(big[1:3, 5:])  # a view with an offset


@pytest.mark.parametrize("width", [49_152, 262_144, 151_936, 128_256, 32_000, 65_537])
def test_chunk_length_divides_the_common_vocabularies(width):
    c = chunk_length(width)
    assert CHUNK // 2 <= c <= 2 * CHUNK
    assert width % c == 0 or (width == 65_537 and c == CHUNK)  # a prime: a ragged tail


def test_the_rule(monkeypatch):
    monkeypatch.undo()  # the real rule
    assert argmax_module.two_passes_pay is two_passes_pay
    vectorised = argmax_module._vectorised()
    assert two_passes_pay(1, 262_144, 2) is vectorised
    assert two_passes_pay(16, 49_152, 2) is vectorised
    assert not two_passes_pay(1, 49_152, 2)  # one row of SmolLM2's vocabulary: one pass
    assert two_passes_pay(2, 65_536, 2) is vectorised  # one row a thread, long enough
    assert not two_passes_pay(128, 2_048, 2)  # short rows
    assert not two_passes_pay(16, 49_152, 16)  # one 49k row per thread
    small = torch.randn(2, 300)  # the single pass, as before
    assert torch.equal(first_argmax(small), small.argmax(dim=-1))
