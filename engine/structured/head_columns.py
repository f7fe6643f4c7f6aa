"""A step's constrained rows as vocabulary columns: ``GrammarColumns`` is the
``SampleColumns`` (engine/runner/logit_columns.py) that lets the logits head compute a row
only at the tokens its grammar allows.

Built by the engine before the forward pass from the step's bitmasks: the plain rows' (which a
worker thread may still be filling: ``columns()`` waits, after the forward pass) and the
speculating rows' (filled before the pass). A row is restricted only where its grammar allows at
most ``ROW_FRACTION`` of the vocabulary (a forced key, an enum, digits); inside a free string
nearly every token is allowed and the row takes the full head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.structured.masking import FilledRows

ROW_FRACTION = 1 / 16

# Where a sampled row's bitmask comes from: a getter of the filled rows (None: nothing
# filled) and the row's index in them; None for an unconstrained row.
RowSource = tuple[Callable[[], FilledRows | None], int] | None


class GrammarColumns:
    """``SampleColumns`` over ``rows`` (one ``RowSource`` per sampled row, in the runner's
    row order), for a grammar vocabulary of ``width`` tokens."""

    def __init__(self, width: int, rows: Sequence[RowSource]) -> None:
        self.width = width
        self._rows = list(rows)

    def columns(self) -> list[torch.Tensor | None]:
        limit = int(self.width * ROW_FRACTION)
        out: list[torch.Tensor | None] = []
        for source in self._rows:
            filled = source[0]() if source is not None else None
            if filled is None or source[1] not in filled.rows:
                out.append(None)
                continue
            packed = filled.bitmask[source[1]].contiguous().numpy().view(np.uint8)
            bits = np.unpackbits(packed, count=self.width, bitorder="little")
            allowed = np.flatnonzero(bits) if int(bits.sum()) <= limit else None
            out.append(None if allowed is None else torch.from_numpy(allowed.astype(np.int64)))
        return out
