"""A pooling request's vector: summed chunk by chunk, finished once the prompt has run."""

from __future__ import annotations

import torch

from engine.params.pooling import PoolingParams


def add_rows(acc: torch.Tensor | None, rows_sum: torch.Tensor) -> torch.Tensor:
    """The running float32 sum of pooled rows, on the host."""
    rows_sum = rows_sum.detach().to("cpu", torch.float32)
    return rows_sum if acc is None else acc + rows_sum


def finish_vector(acc: torch.Tensor, count: int, params: PoolingParams) -> list[float]:
    """The request's result from the sum of ``count`` rows: the mean (``"mean"``), cut to
    ``dimensions`` and L2-normalised where asked; scoring heads' logits as they are."""
    if params.head_token_ids:
        return acc.tolist()
    v = acc / max(count, 1) if params.method == "mean" else acc
    if params.dimensions is not None:
        v = v[:params.dimensions]
    if params.normalize:
        v = torch.nn.functional.normalize(v, p=2, dim=0)
    return v.tolist()
