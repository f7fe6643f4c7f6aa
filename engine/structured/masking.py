"""Applying the constrained rows' grammars to a step's logits, in two halves.

``fill_rows(backend, matchers)`` takes one entry per logits row (a ``Matcher`` or None for an
unconstrained row) and fills the constrained rows' bitmask: it reads only the matchers, not the
logits, so the engine runs it on a worker thread while the step's forward pass computes the
logits (the matchers' states are fixed until the step's tokens are appended). ``apply_rows``
then sets those rows' forbidden logits to -inf in place. ``mask_logits`` does both at once.
With no constrained row nothing is filled (unconstrained batches pay one scan of a list).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine.structured.backend import GrammarBackend, Matcher


@dataclass(frozen=True)
class FilledRows:
    """A bitmask with ``len(matchers)`` rows, of which ``rows`` are filled."""

    bitmask: torch.Tensor
    rows: list[int]


def fill_rows(backend: GrammarBackend, matchers: Sequence[Matcher | None]) -> FilledRows | None:
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = backend.allocate_bitmask(len(matchers))
    backend.fill_bitmasks([matchers[i] for i in rows], bitmask, rows)
    return FilledRows(bitmask, rows)


def apply_rows(backend: GrammarBackend, logits: torch.Tensor, filled: FilledRows | None,
               skip: Collection[int] = ()) -> int:
    """Mask ``logits`` (one row per matcher given to ``fill_rows``); returns the rows
    constrained. Rows in ``skip`` are constrained already (their logits were computed only at
    the allowed tokens) and are not masked again."""
    if filled is None:
        return 0
    rows = [r for r in filled.rows if r not in skip] if skip else filled.rows
    if rows:
        backend.apply_bitmask(logits, filled.bitmask, rows)
    return len(filled.rows)


def mask_logits(backend: GrammarBackend, logits: torch.Tensor,
                matchers: Sequence[Matcher | None]) -> int:
    """Fill and apply at once; returns how many rows it constrained."""
    return apply_rows(backend, logits, fill_rows(backend, matchers))
