"""Engine logprobs -> OpenAI's two logprobs shapes (legacy completions and chat).

Engine positions are ``{token_id: Logprob(logprob, rank, decoded_token)}`` with the chosen token
included; a prompt's first position is ``None``. -inf (a token masked out) is clamped to -9999.0,
as JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any

from engine.request_output import Logprob, PositionLogprobs

_FLOOR = -9999.0


def _lp(value: float) -> float:
    return _FLOOR if math.isnan(value) or value < _FLOOR else float(value)


def token_text(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k most likely alternatives, most likely first (by rank, then by logprob)."""
    ranked = sorted(position.items(),
                    key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                    -kv[1].logprob))
    return ranked[:k]


class CompletionLogprobs:
    """Accumulates the legacy ``{tokens, token_logprobs, top_logprobs, text_offset}`` object;
    ``text_offset`` continues across calls so stream chunks line up with the full text."""

    def __init__(self, tokenizer: Any, k: int, offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.k = k
        self.offset = offset

    def build(self, token_ids: list[int], positions: list[PositionLogprobs | None]
              ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for i, tok in enumerate(token_ids):
            pos = positions[i] if i < len(positions) else None
            chosen = pos.get(tok) if pos else None
            text = token_text(self.tokenizer, tok, chosen)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if pos is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_lp(chosen.logprob) if chosen else None)
            top = {token_text(self.tokenizer, t, lp): _lp(lp.logprob) for t, lp in
                   _top(pos, self.k)}
            if chosen is not None:
                top.setdefault(text, _lp(chosen.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, token_ids: list[int], positions: list[PositionLogprobs],
                  k: int) -> dict[str, Any]:
    """Chat's ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
    content = []
    for tok, pos in zip(token_ids, positions, strict=False):  # positions may lag the tokens
        chosen = pos.get(tok)
        text = token_text(tokenizer, tok, chosen)
        item = _entry(text, chosen.logprob if chosen else _FLOOR)
        item["top_logprobs"] = [_entry(token_text(tokenizer, t, lp), lp.logprob)
                                for t, lp in _top(pos, k)]
        content.append(item)
    return {"content": content, "refusal": None}
