"""Which rows of one scheduled chunk a pooling request pools (the scheduler's plan asks)."""

from __future__ import annotations

from engine.request import Sequence
from engine.step.plan import PoolSpan


def pool_span(seq: Sequence, start: int, num_new: int) -> PoolSpan | None:
    """Positions of this chunk (``start .. start + num_new - 1``) whose final hidden states
    the runner sums for ``seq``'s pooling request, or None (not a pooling request, or no row
    of it here). ``request.pooled_upto``: positions already summed (a recompute preemption
    restarts the prefill at 0; those rows are not summed twice)."""
    req = seq.request
    pooling = req.params.pooling
    if pooling is None:
        return None
    end = start + num_new
    n = req.num_prompt_tokens
    if pooling.method == "last":
        first, last = n - 1, n
    elif pooling.method == "cls":
        first, last = 0, 1
    else:
        first, last = 0, n
    first = max(first, start, req.pooled_upto)
    last = min(last, end)
    if first >= last:
        return None
    return PoolSpan(first, last, pooling.head_token_ids)
