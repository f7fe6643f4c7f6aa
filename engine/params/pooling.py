"""What a pooling request asks of the engine (``SamplingParams.pooling``)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """Run the prompt's prefill only and return one vector instead of generating.

    ``method``: which final-norm hidden states are pooled: the last prompt token's
    (``"last"``), the mean over every prompt token (``"mean"``) or the first token's
    (``"cls"``). ``normalize``: divide by the L2 norm. ``dimensions``: keep the first
    ``dimensions`` features (Matryoshka), then normalise again when ``normalize``.
    ``head_token_ids``: return the last token's logits at these vocabulary ids instead of a
    hidden state (a yes/no reranker's score); ``method`` must be ``"last"`` then.

    ``"last"`` pooling shares the prefix cache like any prompt (a prefix hit never covers a
    prompt's last token); ``"mean"`` and ``"cls"`` need rows a hit would skip, so those
    requests compute every prompt token (they still leave their blocks to the cache).
    """

    method: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    head_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}; "
                             f"got {self.method!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer; got {self.dimensions!r}")
        if self.head_token_ids and self.method != "last":
            raise ValueError("head_token_ids (scoring by logits) needs last-token pooling")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               for t in self.head_token_ids):
            raise ValueError("head_token_ids must be non-negative token ids")

    @property
    def needs_every_row(self) -> bool:
        """Whether rows before the last are pooled (then no prefix-cache lookup)."""
        return self.method != "last"
