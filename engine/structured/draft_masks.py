"""Speculative decoding under a grammar.

A constrained sequence's draft is checked against its matcher twice, neither time leaving the
matcher changed (it advances only by the tokens the engine appends):

* ``grammar_prefix(matcher, draft)``: how many leading draft tokens the grammar allows. The
  scheduler cuts every proposal to that prefix before the step runs, so no forward pass is spent
  on a token that could never be kept.
* ``fill_draft_rows(backend, matcher, draft)`` / ``mask_draft_rows(...)``: the verification
  rows (row ``j`` follows ``draft[:j]``, ``len(draft) + 1`` rows) masked with the grammar's
  state at that position, exactly as one-token decoding would have masked each of them (the
  engine fills them before the forward pass, so that the logits head can skip what the masks
  forbid: engine/runner/logit_columns.py). Verification (greedy or the
  rejection rule) then keeps only tokens the grammar allows, and a rejected draft needs no
  rollback beyond the one done here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.structured.backend import GrammarBackend, Matcher
from engine.structured.masking import FilledRows, apply_rows


def grammar_prefix(matcher: Matcher, draft: Sequence[int]) -> int:
    """The length of ``draft``'s longest prefix the grammar accepts (nothing follows the end of
    the grammar). ``matcher`` is left as it was."""
    n = 0
    for token in draft:
        if matcher.is_terminated() or not matcher.accept(token):
            break
        n += 1
    matcher.rollback(n)
    return n


def fill_draft_rows(backend: GrammarBackend, matcher: Matcher,
                    draft: Sequence[int]) -> FilledRows:
    """The bitmask of a speculating sequence's verification rows, row ``j`` filled by the
    grammar after ``draft[:j]`` (``len(draft) + 1`` rows); ``draft`` must be grammar-valid
    (``grammar_prefix`` of it is its length). Rows after a draft token that ends the grammar
    are not filled: the sequence finishes on that token, so they are never sampled from.
    ``matcher`` is left as it was."""
    bitmask = backend.allocate_bitmask(len(draft) + 1)
    rows: list[int] = []
    accepted = 0
    try:
        for j in range(len(draft) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_bitmask(bitmask, j)
            rows.append(j)
            if j == len(draft):
                break
            if not matcher.accept(draft[j]):
                raise ValueError(f"draft token {draft[j]} at {j} is not allowed by the grammar")
            accepted += 1
    finally:
        matcher.rollback(accepted)
    return FilledRows(bitmask, rows)


def mask_draft_rows(backend: GrammarBackend, logits: torch.Tensor, matcher: Matcher,
                    draft: Sequence[int]) -> int:
    """Mask rows ``0..len(draft)`` of ``logits`` in place with ``fill_draft_rows``'s
    bitmask; returns how many rows were masked. ``matcher`` is left as it was."""
    if logits.shape[0] < len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} rows; "
                         f"got {logits.shape[0]}")
    return apply_rows(backend, logits, fill_draft_rows(backend, matcher, draft))
