"""``GatedMatcher``: a request's matcher while its reasoning model may think.

It wraps the constraint's own matcher (or none: a thinking budget alone) behind a
``ThinkingGate`` (engine/params/thinking.py) and answers the ``Matcher`` protocol in phases:
**idle** (the mask allows the opening marker's first token and whatever the constraint allows;
a token both could begin is the marker's), **opening** (the rest of the marker forced),
**thinking** (every token allowed; the thought's tokens counted and watched for the closing
marker), **forcing** (the budget is spent: only the closing marker's next token; the rest
offered as a jump-forward draft), **answering** (the wrapped matcher from its start state; with
none, everything allowed).

Every accepted token is logged with its phase, so ``rollback`` (speculative drafts, grammar
prefixes) undoes exactly what ``accept`` did, across the phase boundaries too."""

from __future__ import annotations

import torch

from engine.params.thinking import ThinkingGate
from engine.structured.backend import Matcher


def _bit(token: int) -> tuple[int, int]:
    """The int32 word of a bitmask row holding ``token``, and the word's value for it."""
    word, bit = divmod(token, 32)
    return word, (1 << bit) - (1 << 32 if bit == 31 else 0)


def _allow_only(bitmask: torch.Tensor, row: int, token: int) -> None:
    bitmask[row].zero_()
    word, value = _bit(token)
    bitmask[row, word] = value


def _allow_also(bitmask: torch.Tensor, row: int, token: int) -> None:
    word, value = _bit(token)
    bitmask[row, word] |= value


_OPEN, _THOUGHT, _ANSWER = 0, 1, 2  # what an accepted token was (the log's entries)
_IDLE, _OPENING, _THINKING, _ANSWERING = "idle", "opening", "thinking", "answering"


class GatedMatcher:
    __slots__ = ("gate", "inner", "_log", "_opened", "_thought")

    def __init__(self, gate: ThinkingGate, inner: Matcher | None) -> None:
        self.gate = gate
        self.inner = inner
        self._log: list[int] = []  # per accepted token: _OPEN, _THOUGHT or _ANSWER
        self._opened = 0  # tokens of the opening marker taken
        self._thought: list[int] = []  # the thought's tokens (the closing marker's included)

    # ---- state -------------------------------------------------------------------------------

    def _phase(self) -> str:
        if self._log and self._log[-1] == _ANSWER:
            return _ANSWERING
        start, end = self.gate.start_ids, self.gate.end_ids
        if not self.gate.inside and self._opened < len(start):
            return _OPENING if self._opened else _IDLE
        t = self._thought
        if len(t) >= len(end) and tuple(t[-len(end):]) == end:
            return _ANSWERING
        return _THINKING

    def _forced_index(self) -> int | None:
        """Index into ``end_ids`` of the token the budget forces next; None: nothing forced."""
        budget = self.gate.budget
        if budget is None:
            return None
        j = len(self._thought) - budget
        return j if 0 <= j < len(self.gate.end_ids) else None

    def _forced(self, phase: str) -> list[int]:
        """The tokens that must come next, in order ([] where the next one is free)."""
        if phase == _OPENING:
            return list(self.gate.start_ids[self._opened:])
        if phase == _THINKING and (j := self._forced_index()) is not None:
            return list(self.gate.end_ids[j:])
        return []

    @property
    def answering(self) -> bool:
        """The thought is over (or was skipped): the wrapped matcher masks from here."""
        return self._phase() == _ANSWERING

    # ---- the Matcher protocol ----------------------------------------------------------------

    def accept(self, token: int) -> bool:
        token = int(token)
        phase = self._phase()
        if phase == _IDLE and token == self.gate.start_ids[0]:
            phase = _OPENING
        if phase in (_IDLE, _ANSWERING):
            if self.inner is not None and not self.inner.accept(token):
                return False
            self._log.append(_ANSWER)
            return True
        forced = self._forced(phase)
        if forced and token != forced[0]:
            return False
        if phase == _OPENING:
            self._opened += 1
            self._log.append(_OPEN)
        else:
            self._thought.append(token)
            self._log.append(_THOUGHT)
        return True

    def rollback(self, k: int) -> None:
        answers = 0
        for _ in range(min(k, len(self._log))):
            kind = self._log.pop()
            if kind == _ANSWER:
                answers += 1
            elif kind == _OPEN:
                self._opened -= 1
            else:
                self._thought.pop()
        if answers and self.inner is not None:
            self.inner.rollback(answers)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        phase = self._phase()
        if phase in (_IDLE, _ANSWERING) and self.inner is not None:
            self.inner.fill_bitmask(bitmask, row)
            if phase == _IDLE:  # or open the thought
                _allow_also(bitmask, row, self.gate.start_ids[0])
            return
        forced = self._forced(phase)
        if forced:
            _allow_only(bitmask, row, forced[0])
        else:
            bitmask[row].fill_(-1)

    def is_terminated(self) -> bool:
        return self._phase() == _ANSWERING and self.inner is not None and \
            self.inner.is_terminated()

    def error(self) -> str | None:
        if self.inner is not None and self._phase() in (_IDLE, _ANSWERING):
            return self.inner.error()
        return None

    def forced_text(self) -> str:
        phase = self._phase()
        if phase == _ANSWERING:
            return self.inner.forced_text() if self.inner is not None else ""
        # not the marker's text: non-empty, so that the jump-forward drafter (which encodes a
        # forced text first) falls back to forced_tokens
        return "\0" if self._forced(phase) else ""

    def forced_tokens(self) -> list[int]:
        phase = self._phase()
        if phase == _ANSWERING:
            return self.inner.forced_tokens() if self.inner is not None else []
        return self._forced(phase)
