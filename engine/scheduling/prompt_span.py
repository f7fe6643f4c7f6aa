"""Which prompt positions of a scheduled chunk still need their prompt logprobs."""

from __future__ import annotations

from engine.request import Sequence
from engine.step.plan import PromptLogitSpan


def prompt_logit_span(seq: Sequence, start: int, num_new: int) -> PromptLogitSpan | None:
    """Positions of this chunk whose prompt logprobs are still to record, or None.

    Position ``p`` predicts prompt token ``p + 1``; ``request.prompt_logprobs`` holds
    ``None`` then one entry per recorded target, so positions below ``len - 1`` are done. A
    recompute preemption during prefill restarts the chunk at 0: the rows already recorded
    are not asked for again (they were once duplicated).
    """
    req = seq.request
    if seq.index != 0 or not req.wants_prompt_logprobs:
        return None
    done = len(req.prompt_logprobs) - 1 if req.prompt_logprobs else 0
    first = max(start, done)
    last = min(start + num_new, req.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptLogitSpan(first, last, tuple(req.prompt_token_ids[first + 1:last + 1]),
                           req.params.prompt_logprobs or 0)
