"""Per-request sampling and stopping parameters (vLLM's ``SamplingParams`` shape).

Validated at construction: every bad value raises ``ValueError`` naming the field, which the
server turns into an OpenAI-style 400 error. Lists that cost engine work per generated token
are capped (``MAX_*`` below): stop strings and stop token ids are checked every token, logit
bias entries are applied every step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engine.params.pooling import PoolingParams
from engine.params.structured import StructuredSpec
from engine.params.thinking import ThinkingGate

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 2048


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) disables top-k. ``seed`` makes the
    samples of this request reproducible whatever else shares its batch. ``logprobs=k`` returns
    the chosen token's log-probability and the top ``k`` alternatives per generated token;
    ``prompt_logprobs=k`` does the same for the prompt tokens. ``stop`` strings end generation and
    are removed from the text (unless ``include_stop_str_in_output``). ``structured``: a
    constraint (JSON schema, regex, choice, grammar) every generated sequence follows; its
    logits are masked before any processing, and EOS is allowed only where it can end.
    ``thinking``: a reasoning model's thought gate (engine/params/thinking.py): the
    constraint applies after the thought, which a budget may bound.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None
    structured: StructuredSpec | None = None
    thinking: ThinkingGate | None = None
    # A pooling request (engine.pooling): prefill only, one vector back, nothing generated.
    pooling: PoolingParams | None = None
    # The LoRA adapter the request runs under, by its loaded name (None: the base model).
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_caps()
        if not all(isinstance(s, str) for s in (self.stop or [])):
            raise ValueError(f"stop must be a string or a list of strings; got {self.stop!r}")
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                # JSON object keys arrive as strings ("50256"): accept any integer spelling.
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers; got "
                                 f"{self.logit_bias!r}") from e
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _check_caps(self) -> None:
        """Refuse oversized lists before any per-element work (O(1) each, plus the stop
        strings' lengths)."""
        stop = self.stop if isinstance(self.stop, (list, tuple)) else []
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are "
                             f"allowed")
        for s in stop:
            if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters; at most "
                                 f"{MAX_STOP_STRING_CHARS} are allowed")
        ids = self.stop_token_ids
        n_ids = len(ids) if isinstance(ids, (list, tuple)) else 0
        if n_ids > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {n_ids} ids; at most {MAX_STOP_TOKEN_IDS} are "
                             f"allowed")
        if isinstance(self.logit_bias, dict) and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most "
                             f"{MAX_LOGIT_BIAS} are allowed")

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}; got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                raise bad(name, "must be an integer")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            v = getattr(self, name)
            if v is not None and not is_int(v):
                raise bad(name, "must be an integer or None")
        if not all(is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of integer token ids")
        if self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be >= 0")
        if self.logit_bias:
            for tok, val in self.logit_bias.items():
                if tok < 0:
                    raise ValueError(f"logit_bias has a negative token id {tok}")
                if not -100.0 <= val <= 100.0:  # also rejects NaN
                    raise ValueError(f"logit_bias values must be in [-100, 100]; got {val} "
                                     f"for token {tok}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise bad("structured", "must be a StructuredSpec or None")
        if self.thinking is not None and not isinstance(self.thinking, ThinkingGate):
            raise bad("thinking", "must be a ThinkingGate or None")
        if self.pooling is not None and not isinstance(self.pooling, PoolingParams):
            raise bad("pooling", "must be a PoolingParams or None")
        if self.pooling is not None and self.n != 1:
            raise bad("n", "must be 1 for a pooling request")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)
