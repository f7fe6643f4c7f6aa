"""``SpeculativeConfig``: vLLM's ``speculative_config`` JSON object, validated.

Accepted as a dict, a JSON string of one, a ``SpeculativeConfig``, or None (speculation off).
Keys (vLLM's names): ``method`` (``"ngram"``: prompt lookup, or ``"draft_model"``:
``engine.spec_decode.draft_model``); ``num_speculative_tokens`` (k, 1..16, default 3:
docs/decisions.md#speculative-tokens-default; vLLM has none); ``prompt_lookup_max`` /
``prompt_lookup_min`` (n-gram sizes tried, longest first; ngram only; defaults 4 and 2);
``model`` (the draft model; draft_model only); ``disable_by_batch_size`` (a step speculates only
while at most this many sequences decode; missing:
:data:`DEFAULT_DISABLE_BY_BATCH_SIZE`, docs/decisions.md#speculation-batch-limit; ``null``:
never switch off).

Unknown keys raise ``ValueError`` naming the known ones: a misspelt key must not silently
leave speculation configured otherwise than asked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.config.json_object import json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# Decoding sequences per step above which speculation is switched off: from two sequences
# on, verifying the drafts' extra rows cost more than n-gram drafts save (chosen by
# measurement: see docs/decisions.md#speculation-batch-limit).
DEFAULT_DISABLE_BY_BATCH_SIZE = 1


@dataclass(frozen=True)
class SpeculativeConfig:
    """How (and whether) sequences speculate. Frozen and validated at construction."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = 4
    prompt_lookup_min: int | None = 2
    model: str | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}; "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}; got {k!r}")
        d = self.disable_by_batch_size
        if d is not None and (not _is_int(d) or d < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1 "
                             f"(or null: never switch speculation off); got {d!r}")
        if self.method == "ngram":
            self._check_ngram()
        else:
            if not self.model or not isinstance(self.model, str):
                raise ValueError('speculative_config: method "draft_model" needs "model" (a '
                                 "path or GGUF of a small model with the same tokenizer)")
            object.__setattr__(self, "prompt_lookup_min", None)
            object.__setattr__(self, "prompt_lookup_max", None)

    def _check_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = 2, 4
        elif lo is None:
            lo = 1
        elif hi is None:
            hi = lo
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1; got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed "
                             f"prompt_lookup_max ({hi})")
        if self.model is not None:
            raise ValueError('speculative_config: "model" is for method "draft_model", not '
                             '"ngram"')
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """Normalise any accepted form (see the module docstring); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config",
                            '{"method": "ngram", "num_speculative_tokens": 4}', cls)
        if value is None:
            return None
        if "method" not in value:
            raise ValueError('speculative_config needs "method" ("ngram" or "draft_model")')
        kwargs = dict(value)
        if value["method"] == "draft_model" and {"prompt_lookup_min",
                                                 "prompt_lookup_max"} & set(value):
            raise ValueError('speculative_config: prompt_lookup_min/max are for method "ngram", '
                             'not "draft_model"')
        if value["method"] == "ngram" and "prompt_lookup_min" in value \
                and "prompt_lookup_max" not in value:
            kwargs["prompt_lookup_max"] = None  # vLLM: a lone min sets both
        if value["method"] == "ngram" and "prompt_lookup_max" in value \
                and "prompt_lookup_min" not in value:
            kwargs["prompt_lookup_min"] = None  # vLLM: a lone max goes down to 1
        return cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        """The JSON object this config reads back from (``--print-config``, round trips)."""
        out = dataclasses.asdict(self)
        for key in ("model",) if self.method == "ngram" else ("prompt_lookup_min",
                                                              "prompt_lookup_max"):
            out.pop(key)
        return out

    def describe(self, quantised_up_to: int | None = None) -> str:
        """One log line; ``quantised_up_to``: the row count above which the model's packed
        quantised linears hand over to float ones (a k + 1 row verification beyond it runs
        at float speed)."""
        ngram = (f" n={self.prompt_lookup_min}..{self.prompt_lookup_max}"
                 if self.method == "ngram" else f" draft {self.model}")
        off = ("at every batch size" if self.disable_by_batch_size is None else
               f"while at most {self.disable_by_batch_size} sequences decode")
        out = f"{self.method}{ngram}, k={self.num_speculative_tokens}, {off}"
        if quantised_up_to is not None and self.num_speculative_tokens + 1 > quantised_up_to:
            out += (f"; a verification step of k+1 > {quantised_up_to} rows leaves the "
                    f"quantised linears for the float ones (k <= {quantised_up_to - 1} keeps it "
                    f"on them)")
        return out

    def speculates_at(self, num_decoding: int) -> bool:
        """Whether a step with ``num_decoding`` decoding sequences speculates (adaptive)."""
        return self.disable_by_batch_size is None or num_decoding <= self.disable_by_batch_size


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
