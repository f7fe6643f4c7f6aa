"""What the engine hands back: per-request outputs (vLLM's ``RequestOutput`` shape).

Outputs are cumulative: each ``RequestOutput`` a step emits holds all text and tokens produced so
far. Streaming consumers compute deltas by remembering how much they already sent; text that
might still become a stop string is held back and only appears once it is known not to.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, with its rank (1 = most likely) and decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the chosen token plus top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()``) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine could not finish the request
    # With ``error``: a code when the request's own input was at fault (e.g.
    # "constraint_failed", a 400 for the server), None for an internal error (a 500).
    error_code: str | None = None
    # A pooling request's vector (``SamplingParams.pooling``; engine.pooling): the pooled
    # hidden state, or a scoring head's logits; None for a generation request.
    pooled: list[float] | None = None
