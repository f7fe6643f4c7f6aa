"""``SamplingRow``: what the sampler and the logit processors know about one row of a step's
logits. It stands below both ``engine.sampling.sampler`` and ``engine.sampling.penalties``, which import it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.params.sampling import SamplingParams


@dataclass
class SamplingRow:
    """One row of the step's logits and what the sampler needs to know about its sequence."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far by this row
    generator: torch.Generator | None  # set iff params.seed is not None; advanced only by it
    eos_token_ids: frozenset[int]  # masked (with stop_token_ids) while output < min_tokens
    # Lives as long as the request: logit processors keep what they build once (the
    # logit-bias tensors) here. None: build every call.
    cache: dict | None = None
