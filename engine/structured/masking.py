"""Applying the constrained rows' grammars to a step's logits.

``mask_logits(backend, logits, matchers)`` takes one entry per logits row (a ``Matcher`` or None
for an unconstrained row): it fills the constrained rows' bitmask and sets their forbidden logits
to -inf in place. With no constrained row it does nothing at all (unconstrained batches pay one
scan of a Python list). Returns how many rows it constrained.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.structured.backend import GrammarBackend, Matcher


def mask_logits(backend: GrammarBackend, logits: torch.Tensor,
                matchers: Sequence[Matcher | None]) -> int:
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return 0
    bitmask = backend.allocate_bitmask(logits.shape[0])
    backend.fill_bitmasks([matchers[i] for i in rows], bitmask, rows)
    backend.apply_bitmask(logits, bitmask, rows)
    return len(rows)
