"""``ReasoningSplitter``: a model's output cut into its thought and its answer, as it streams.

One thought at most, at the start of the output: before the opening marker only whitespace may
come (else there is no thought and everything is answer); after the closing marker everything
is answer, its leading whitespace dropped. An output that starts inside the thought (the prompt
opened it: ``ReasoningFormat.starts_thinking``) needs no opening marker, and one cut before the
closing marker is all thought. ``feed(delta)`` returns ``(reasoning, content)`` for a piece of
text, holding back any tail that could still be the start of a marker, so that a marker split
across tokens never leaks into either field; ``finish()`` releases what is held. ``split(text)``
does it for a whole output. The markers themselves appear in neither field.
"""

from __future__ import annotations

from server.reasoning.formats import ReasoningFormat

_BEFORE, _THINKING, _ANSWER = "before", "thinking", "answer"


class ReasoningSplitter:
    def __init__(self, fmt: ReasoningFormat, thinking: bool = False) -> None:
        self.fmt = fmt
        self.state = _THINKING if thinking else _BEFORE
        self._held = ""  # text not yet given out (a possible marker prefix)
        self._answer_started = False
        self.thought_ended = False  # the closing marker was seen

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning, content = [], []
        while text:
            if self.state == _BEFORE:
                body = text.lstrip()
                if body.startswith(self.fmt.start):
                    self.state, text = _THINKING, body[len(self.fmt.start):]
                elif self.fmt.start.startswith(body):  # whitespace or a marker's beginning
                    self._held = text
                    text = ""
                else:
                    self.state = _ANSWER
            elif self.state == _THINKING:
                at = text.find(self.fmt.end)
                if at >= 0:
                    reasoning.append(text[:at])
                    self.state, self.thought_ended = _ANSWER, True
                    text = text[at + len(self.fmt.end):]
                    continue
                keep = _partial_suffix(text, self.fmt.end)
                reasoning.append(text[:len(text) - keep])
                self._held, text = text[len(text) - keep:], ""
            else:
                if not self._answer_started:
                    text = text.lstrip()
                    if not text:
                        break
                    self._answer_started = True
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held, now that no more text comes."""
        held, self._held = self._held, ""
        if self.state == _THINKING:
            return held, ""
        if self.state == _BEFORE:
            return "", held.lstrip()
        return "", held

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output: ``(reasoning or None when there was no thought, content)``."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        thought = self.thought_ended or self.state == _THINKING
        return (r1 + r2 if thought else None), c1 + c2


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
