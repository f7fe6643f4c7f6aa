"""The thinking gate of one chat request (engine/params/thinking.py), built from its rendered
prompt.

A request gets a gate when its output may open with a thought and something must happen at the
thought's end: a constraint (``response_format``, a tool call), which then applies from the
closing marker on while the thought stays free (vLLM's structured outputs with a reasoner), or a
thinking budget (``thinking_token_budget``, else the server's ``--reasoning-budget``), after
which the closing marker is forced. A prompt whose thought is closed already (Qwen3's template
with ``enable_thinking: false`` ends with an empty think block) gets none: the constraint applies
from the first token.
"""

from __future__ import annotations

from typing import Any

from engine.params.sampling import SamplingParams
from engine.params.thinking import ThinkingGate
from server.reasoning.formats import ReasoningFormat


def marker_ids(tokenizer: Any, marker: str) -> tuple[int, ...]:
    """The marker's token ids, as the tokenizer writes it (one id for Qwen3's ``</think>``)."""
    return tuple(int(t) for t in tokenizer.encode(marker, add_special_tokens=False))


def thinking_gate(fmt: ReasoningFormat | None, tokenizer: Any, prompt: str,
                  params: SamplingParams, budget: int | None) -> ThinkingGate | None:
    """The gate for ``prompt`` (rendered) under ``params``; None when none is needed.
    ``budget``: thought tokens allowed (None or < 0: unbounded)."""
    if budget is not None and budget < 0:
        budget = None
    if fmt is None or fmt.thought_closed(prompt):
        return None
    if params.structured is None and budget is None:
        return None
    return ThinkingGate(marker_ids(tokenizer, fmt.start), marker_ids(tokenizer, fmt.end), budget,
                        inside=fmt.starts_thinking(prompt))
