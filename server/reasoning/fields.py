"""What the endpoints report of a thought: the number of output tokens it took
(``usage.completion_tokens_details.reasoning_tokens``, ``output_tokens_details`` in the
Responses API), counted on the output's own tokens up to and including the closing marker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server.reasoning.formats import ReasoningFormat


def reasoning_tokens(tokenizer: Any, fmt: ReasoningFormat, token_ids: Sequence[int],
                     reasoning: str | None, ended: bool) -> int:
    """Output tokens spent thinking: up to the closing marker's tokens when the thought ended
    (found in the output's ids; else the thought's text re-encoded), all of them when it did
    not end, 0 when there was no thought."""
    if reasoning is None:
        return 0
    if not ended:
        return len(token_ids)
    marker = list(tokenizer.encode(fmt.end, add_special_tokens=False))
    at = _find(list(token_ids), marker) if marker else -1
    if at >= 0:
        return at + len(marker)
    return min(len(token_ids), len(tokenizer.encode(reasoning, add_special_tokens=False))
               + len(marker))


def _find(ids: list[int], sub: list[int]) -> int:
    n = len(sub)
    for i in range(len(ids) - n + 1):
        if ids[i:i + n] == sub:
            return i
    return -1
