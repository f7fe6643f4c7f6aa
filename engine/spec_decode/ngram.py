"""N-gram (prompt lookup) proposer: drafts copied from earlier in the context.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: find the LATEST earlier
occurrence of the context's last n tokens (not the suffix itself) and propose the tokens that
followed it. Where the continuation runs into the end of the context it goes on with the draft
itself (``ctx[i + n + m]`` over context + draft), which is what the match predicts for periodic
text: a repeated phrase shorter than k still yields k tokens.

Cost per sequence and step: O(len(context) * n) vectorised compares per n tried (numpy), no
state kept between steps (a sequence may be preempted, truncated or swapped at any time).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.spec_decode.proposer import DraftRequest


def ngram_draft(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens continuing ``token_ids`` after the latest earlier match of its last
    n tokens (n tried from ``n_max`` down to ``n_min``); [] when nothing matches. Pure."""
    length = len(token_ids)
    if k < 1 or length < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting at 0 .. length-1-n: every occurrence other than the suffix itself.
        windows = sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if hits.size:
            src = int(hits[-1]) + n
            ctx = list(token_ids[src:length])
            draft: list[int] = []
            for m in range(k):
                draft.append(ctx[m] if m < len(ctx) else draft[m - len(ctx)])
            return draft
    return []


class NgramProposer:
    """Prompt-lookup drafts (``Proposer``); see the module docstring."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def release(self, seq_id: str) -> None:
        """Nothing is kept per sequence."""

    def propose(self, batch: Sequence[DraftRequest]) -> list[list[int]]:
        return [ngram_draft(r.token_ids, min(self.k, r.max_tokens), self.n_min, self.n_max)
                for r in batch]
