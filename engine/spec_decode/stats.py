"""Speculative-decoding counters, named as vLLM names its metrics.

``SpecDecodeCounters`` is updated on the engine thread after every verification;
``snapshot()`` gives the frozen ``SpecDecodeStats`` carried by ``engine.stats.EngineStats``
(and from there to ``/metrics`` as ``kvserve:spec_decode_*_total`` and ``LLM.stats()``).

* ``num_drafts``: verifications of a non-empty draft (one per sequence and step);
* ``num_draft_tokens``: tokens proposed in those drafts;
* ``num_accepted_tokens``: draft tokens accepted (the target's own token of each step is not
  counted: acceptance rate = accepted / draft tokens);
* ``accepted_per_pos[j]``: drafts whose token j was accepted (j = 0 .. k-1); position j's
  acceptance rate is ``accepted_per_pos[j] / num_drafts``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


class SpecDecodeCounters:
    """The mutable side (engine thread only)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft of ``num_draft_tokens`` of which the first ``num_accepted``
        were accepted."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               tuple(self.accepted_per_pos))
