"""A row's ``n`` largest logits, as ``torch.topk`` gives them, without sorting the vocabulary.

``torch.topk`` over a CPU row of a large vocabulary is a per-step cost of top-k and top-p
sampling (docs/decisions.md#topk-over-candidates). The ``n`` largest values all lie in the ``n``
chunks with the largest maxima: if the ``n``-th largest chunk maximum is t, at least ``n``
values are >= t, so the ``n``-th largest value is >= t, and every value above it sits in a chunk
whose maximum is >= it (a tie at t may come from an equal chunk: a tie either way, as topk's
own choice among ties). So: the chunks' maxima (``amax``, vectorised and threaded), ``topk``
over them, ``topk`` over the ``n`` chosen chunks' values only (``n x CHUNK`` of them). The
values are topk's, bit for bit, sorted largest first; the indices are topk's wherever values
are not tied."""

from __future__ import annotations

import torch

CHUNK = 64
# Rows shorter than this many chunks per candidate go straight to torch.topk (the chosen
# chunks would be a large part of the row).
MIN_CHUNKS_PER_CANDIDATE = 8


def top_candidates(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(n, dim=-1)`` of a 2-D ``x``: ``(values, indices)``, largest first."""
    rows, width = x.shape
    if (x.device.type != "cpu" or width % CHUNK
            or width < n * CHUNK * MIN_CHUNKS_PER_CANDIDATE):
        return x.topk(n, dim=-1)
    chunks = x.reshape(rows, width // CHUNK, CHUNK)
    best = chunks.amax(dim=-1).topk(n, dim=-1).indices  # [rows, n] chunk numbers
    picked = chunks[torch.arange(rows, device=x.device).unsqueeze(1), best]  # [rows, n, CHUNK]
    values, at = picked.reshape(rows, n * CHUNK).topk(n, dim=-1)
    index = best.gather(1, at // CHUNK) * CHUNK + at % CHUNK
    return values, index
