"""The logits head restricted to a grammar's allowed tokens (engine/runner/logit_columns.py,
engine/structured/head_columns.py): a packed head computes a column subset bit for bit as the
full head does, the assembled rows are the full head's rows with -inf outside the allowed
tokens (what masking leaves), and every case the head cannot promise falls back to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quantization.linear import QuantLinear
from engine.quantization.rtn import quantise
from engine.runner.logit_columns import restricted_logits
from engine.structured.head_columns import ROW_FRACTION, GrammarColumns
from engine.structured.masking import FilledRows

VOCAB, HIDDEN = 512, 64


def _head(scheme: str, invariant: bool, bias: bool = False, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    b = torch.randn(VOCAB, generator=g) if bias else None
    lin = QuantLinear(quantise(weight, scheme, 32), b)
    if invariant:
        lin.set_batch_invariant()
    return lin


def _columns(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(VOCAB, generator=g)[:n].sort().values


@pytest.mark.parametrize("scheme,invariant,bias", [("int8", True, False), ("int8", False, True),
                                                    ("int4", False, False)])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_a_column_subset_is_the_full_heads_columns_bit_for_bit(scheme, invariant, bias, rows):
    lin = _head(scheme, invariant, bias)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    full = lin(x)
    for seed, n in ((0, 1), (1, 7), (2, 100), (3, VOCAB)):
        cols = _columns(seed, n)
        got = lin.forward_columns(x, cols)
        assert got is not None and torch.equal(got, full[:, cols])


def test_a_head_off_its_per_row_kernels_declines():
    blocked = _head("int4", invariant=True)  # 4-bit batch-invariant: the blocked layout
    assert blocked.forward_columns(torch.randn(2, HIDDEN), _columns(0, 8)) is None
    wide = _head("int8", invariant=False)  # above dense_rows the panels serve: not gathered
    assert wide.forward_columns(torch.randn(wide.dense_rows + 1, HIDDEN), _columns(0, 8)) is None


class _Model:
    """The two calls ``restricted_logits`` makes of a model, over one packed head."""

    def __init__(self, head: QuantLinear, declines: bool = False) -> None:
        self.head, self.declines, self.column_calls = head, declines, 0

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    def compute_logits_columns(self, hidden, columns):
        self.column_calls += 1
        return None if self.declines else self.head.forward_columns(hidden, columns)


class _Columns:
    def __init__(self, width, cols):
        self.width, self._cols = width, cols

    def columns(self):
        return self._cols


def _masked(full: torch.Tensor, cols: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """The full head's logits with each restricted row's forbidden tokens (below ``width``)
    at -inf: what masking the full head gives."""
    out = full.clone()
    for i, c in enumerate(cols):
        if c is not None:
            keep = torch.zeros(full.shape[1], dtype=torch.bool)
            keep[c] = True
            keep[width:] = True
            out[i, ~keep] = float("-inf")
    return out


@pytest.mark.parametrize("width", [VOCAB, VOCAB - 12])  # a model vocabulary padded past 500
def test_restricted_rows_equal_the_masked_full_head(width):
    model = _Model(_head("int8", invariant=True))
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    cols = [_columns(4, 3), None, _columns(5, 20), torch.tensor([0, 499]), None]
    logits, restricted = restricted_logits(model, hidden, VOCAB, _Columns(width, cols))
    assert restricted == [0, 2, 3] and model.column_calls == 1
    assert torch.equal(logits, _masked(model.compute_logits(hidden), cols, width))


def test_the_full_head_serves_when_nothing_is_restricted_or_too_much_is():
    model = _Model(_head("int8", invariant=True))
    hidden = torch.randn(2, HIDDEN)
    full = model.compute_logits(hidden)
    for cols in ([None, None], [_columns(0, VOCAB // 2), None]):
        logits, restricted = restricted_logits(model, hidden, VOCAB, _Columns(VOCAB, cols))
        assert restricted == [] and torch.equal(logits, full)
    logits, restricted = restricted_logits(model, hidden, VOCAB, None)
    assert restricted == [] and torch.equal(logits, full) and model.column_calls == 0


def test_a_declining_head_gets_the_full_head():
    model = _Model(_head("int8", invariant=True), declines=True)
    hidden = torch.randn(2, HIDDEN)
    logits, restricted = restricted_logits(model, hidden, VOCAB,
                                           _Columns(VOCAB, [_columns(0, 4), None]))
    assert restricted == [] and model.column_calls == 1
    assert torch.equal(logits, model.compute_logits(hidden))


def _bitmask(rows: list[list[int]], width: int) -> torch.Tensor:
    """xgrammar's layout: bit t of a row's little-endian int32 words set = token t allowed."""
    bits = np.zeros((len(rows), -(-width // 32) * 32), dtype=np.uint8)
    for r, ids in enumerate(rows):
        bits[r, ids] = 1
    return torch.from_numpy(np.packbits(bits, axis=-1, bitorder="little").view(np.int32))


def test_grammar_columns_restrict_only_narrow_filled_rows():
    width = 1024
    narrow, wide = [3, 31, 32, 1000], list(range(int(width * ROW_FRACTION) + 1))
    filled = FilledRows(_bitmask([narrow, wide, [7]], width), rows=[0, 1])  # row 2 not filled
    calls = []

    def source():
        calls.append(1)
        return filled

    cols = GrammarColumns(width, [(source, 0), (source, 1), (source, 2), None]).columns()
    assert cols[0].tolist() == narrow and cols[0].dtype == torch.int64
    assert cols[1:] == [None, None, None] and len(calls) == 3
