"""What a speculative proposer is to the scheduler: one batched call per step.

The scheduler asks, once per speculating step, for drafts of every sequence that decodes; a
proposer answers with at most ``max_tokens`` token ids per sequence (an empty draft: that
sequence decodes one token as usual). Drafts are guesses: verification (``engine.spec_decode
.verifier``) keeps exactly the tokens the target model would have produced, so a proposer can
only change speed, never output. Proposers see token ids only (no ``Sequence``, no KV manager).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One sequence's context (prompt + generated tokens, the last one not yet computed) and
    the most draft tokens it may take this step (>= 1)."""

    seq_id: str
    token_ids: Sequence[int]
    max_tokens: int


class Proposer(Protocol):
    def propose(self, batch: Sequence[DraftRequest]) -> list[list[int]]:
        """One draft per request, in order; each at most ``max_tokens`` long (may be empty)."""
        ...

    def release(self, seq_id: str) -> None:
        """``seq_id`` has ended: drop whatever the proposer keeps for it."""
        ...
