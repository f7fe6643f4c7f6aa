"""Requests and the sequences the scheduler moves around.

A ``Request`` is what a client asked for (one prompt, ``n`` samples). Each sample is a
``Sequence``: the scheduling and KV-allocation unit, with its own block table (keyed by
``seq_id``), its own generated tokens and its own text state. With ``n > 1`` the samples share
the prompt's full KV blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.params.prompt_image import PromptImage
from engine.params.sampling import SamplingParams
from engine.request_output import PositionLogprobs, RequestMetrics

if TYPE_CHECKING:
    from engine.postprocess.stop import SequenceTextState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    index: int
    request: Request
    token_ids: list[int]  # prompt followed by generated tokens
    text_state: SequenceTextState
    generator: torch.Generator | None
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    admit_order: int = -1  # when it was last admitted to the running set (for preemption)
    lora_slot: int = -1  # the LoRA slot it pins while running or swapped out (-1: none)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # The grammar this sequence follows (engine.structured.backend.Matcher), None when
    # unconstrained: advanced by every appended token, on the engine thread only.
    matcher: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_order: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prefix-cache hit of the first admission
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cache_extra_keys: tuple = ()
    # The prompt's images (engine.params.prompt_image), by offset; () for a text prompt.
    images: tuple[PromptImage, ...] = ()
    # The LoRA adapter it runs under (engine.adapters; 0: the base model), fixed on arrival.
    lora_id: int = 0
    error: str | None = None  # why the engine ended it, when an internal error did
    # Set with ``error`` when the request's own input is at fault (e.g. "constraint_failed":
    # its grammar failed while it ran); None: an internal error.
    error_code: str | None = None
    # Per-request scratch of the logit processors (engine.sampling.penalties), e.g. the logit-bias
    # tensors, built once instead of every step.
    sampler_cache: dict = field(default_factory=dict)
    # The compiled grammar's Future while ``params.structured`` is set (engine.structured).
    grammar: Any = None
    # A pooling request (``params.pooling``, engine.pooling): the float32 sum of the rows
    # pooled so far, the prompt positions summed, and the finished vector.
    pooled_sum: torch.Tensor | None = None
    pooled_upto: int = 0
    pooled: list[float] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None
