"""Per-sequence output text and the stop checks (stop tokens, EOS, stop strings, max_tokens).

``SequenceTextState.append`` takes one generated token, detokenizes it incrementally and decides
whether the sequence is finished, in vLLM's order: (1) EOS (unless ``ignore_eos``) or a
``stop_token_ids`` member -> ``"stop"``, ``stop_reason`` the token id or ``None`` for EOS; not
for the first ``min_tokens`` tokens; EOS never adds text, a stop token only with
``include_stop_str_in_output``. (2) A stop string completed by the new text -> ``"stop"``,
``stop_reason`` the string, the text cut before it (after it with
``include_stop_str_in_output``); of several, the one that ends first wins (the earliest-starting
on a tie); an occurrence must end in the new text, and a stop token's own text is not searched.
(3) ``max_tokens`` generated -> ``"length"``.
``text`` is what a client may see now. While running, the longest suffix that is a proper prefix
of some stop string is held back, so no visible text contains a stop string (unless
``include_stop_str_in_output``) and each visible text is a prefix of the next and of the final
one. At finish everything legitimate is visible, an incomplete trailing character as U+FFFD."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.params.sampling import SamplingParams
from engine.postprocess.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class FinishInfo:
    reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS / length


class SequenceTextState:
    """Token ids, decoded text and finish state of one generated sequence.

    Only ``append`` and ``finish`` change it; after the sequence is finished both raise.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: frozenset[int]):
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._stops: list[str] = list(params.stop)
        self._detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        # Held back text only matters when the stop string is cut away.
        self._hold = bool(self._stops) and not params.include_stop_str_in_output
        # Per stop string: the longest suffix of the text that is a proper prefix of it.
        self._held = [0] * len(self._stops)
        self.token_ids: list[int] = []
        self._text = ""  # everything decoded (cut at the stop string once one matched)
        self._visible = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        """The visible cumulative output text."""
        return self._text[:self._visible]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> FinishInfo | None:
        """Add one generated token; return how the sequence finished, or None if it runs on."""
        if self.finished:
            raise RuntimeError(f"append() after the sequence finished ({self.finish_reason})")
        p = self.params
        self.token_ids.append(token_id)
        n = len(self.token_ids)
        past_min = n > p.min_tokens
        is_eos = past_min and not p.ignore_eos and token_id in self.eos_token_ids
        is_stop_token = past_min and not is_eos and token_id in self._stop_token_ids
        at_max = p.max_tokens is not None and n >= p.max_tokens

        old_len = len(self._text)
        if not is_eos and (not is_stop_token or p.include_stop_str_in_output):
            self._text += self._detok.add_token(token_id)
        if is_eos or is_stop_token or at_max:
            self._text += self._detok.flush()

        info: FinishInfo | None = None
        if is_eos:
            info = FinishInfo("stop", None)
        elif is_stop_token:
            info = FinishInfo("stop", token_id)
        # A stop token's own text (kept with include_stop_str_in_output) is not searched: the
        # token already decided how the sequence ends, and the user asked for its text.
        if (self._stops and past_min and len(self._text) > old_len
                and not (is_stop_token and p.include_stop_str_in_output)):
            match = self._find_stop(old_len)
            if match is not None:
                start, stop = match
                self._text = self._text[:start + len(stop) if p.include_stop_str_in_output
                                        else start]
                info = info or FinishInfo("stop", stop)
        if info is None and at_max:
            info = FinishInfo("length", None)

        if info is not None:
            self._set_finished(info)
        elif self._hold:
            self._visible = len(self._text) - self._held_back(len(self._text) - old_len)
        else:
            self._visible = len(self._text)
        return info

    def finish(self, reason: str = "length") -> FinishInfo:
        """End the sequence from outside (max_model_len reached: "length"; "abort").

        The held-back text becomes visible, as on any finish.
        """
        if self.finished:
            raise RuntimeError(f"finish() after the sequence finished ({self.finish_reason})")
        old_len = len(self._text)
        self._text += self._detok.flush()
        info = FinishInfo(reason, None)
        if self._stops and len(self._text) > old_len:
            match = self._find_stop(old_len)
            if match is not None:
                start, stop = match
                self._text = self._text[:start + len(stop) if self.params.include_stop_str_in_output
                                        else start]
                info = FinishInfo("stop", stop)
        self._set_finished(info)
        return info

    def _set_finished(self, info: FinishInfo) -> None:
        self.finish_reason = info.reason
        self.stop_reason = info.stop_reason
        self._visible = len(self._text)

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The stop string occurrence that ends first among those ending after ``old_len``."""
        text = self._text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # An occurrence starting here or later ends inside the new text; find() gives the
            # earliest, which for a fixed string is also the one that ends first.
            i = text.find(stop, max(0, old_len - len(stop) + 1))
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        return None if best is None else (best[1], best[2])

    def _held_back(self, new_chars: int) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string.

        Incremental: a stop's match can grow by at most the ``new_chars`` just appended (its
        part before them was a match of the old text), so only the last ``held + new_chars``
        characters are scanned per stop. Cost per token: amortised O(new text) per stop, not
        O(len(stop)^2) per stop and token (64 stops of 1,000 characters are allowed).
        """
        text = self._text
        longest = 0
        for i, stop in enumerate(self._stops):
            span = min(len(stop) - 1, len(text), self._held[i] + new_chars)
            held = 0
            if span > 0:
                tail = text[len(text) - span:]
                # Start positions left to right: the first that fits is the longest suffix.
                j = tail.find(stop[0])
                while j >= 0:
                    if stop.startswith(tail[j:]):
                        held = span - j
                        break
                    j = tail.find(stop[0], j + 1)
            self._held[i] = held
            longest = max(longest, held)
        return longest
