"""``ThinkingGate``: where a reasoning model's thought ends, and how long it may be.

A request of a reasoning model (the server's ``--reasoning-parser``) carries one when its output
may begin with a thought and something must happen at the thought's end: its constraint
(``SamplingParams.structured``: a JSON schema, a tool call) applies only from the token after
``end_ids``, the thought itself being free, and with a ``budget`` the thought holds at most that
many tokens, after which ``end_ids`` are forced (llama.cpp's ``--reasoning-budget``, vLLM's
``thinking_token_budget``). ``inside``: the prompt opened the thought (DeepSeek-R1's template
ends with ``<think>``), so the count starts at the first output token; otherwise it starts after
``start_ids`` appear in the output. The engine keeps the state (engine/structured/gated.py).
Markers are matched on token ids: the tokenizer's own encoding of each marker, as vLLM's
reasoning parsers match them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingGate:
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    budget: int | None = None  # thought tokens before end_ids are forced; None: unbounded
    inside: bool = False  # the prompt opened the thought

    def __post_init__(self) -> None:
        for name in ("start_ids", "end_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"ThinkingGate.{name} must be a non-empty tuple of token ids; "
                                 f"got {ids!r}")
        if self.budget is not None and (not isinstance(self.budget, int) or
                                        isinstance(self.budget, bool) or self.budget < 0):
            raise ValueError(f"the thinking budget must be an integer >= 0 or None; "
                             f"got {self.budget!r}")
