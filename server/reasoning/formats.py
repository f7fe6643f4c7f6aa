"""The reasoning formats, named as vLLM's ``--reasoning-parser``.

A format is the pair of markers a model writes its thinking between. ``qwen3`` (Qwen3, QwQ,
Qwen3-Thinking), ``deepseek_r1`` (DeepSeek-R1 and its distills) and ``deepseek_v3`` (V3.1+ in
thinking mode) all write ``<think>`` ... ``</think>``; ``kimi_k2`` writes ``◁think▷`` ...
``◁/think▷``. They differ in who writes the opening marker: Qwen3's model does, DeepSeek-R1's
template ends the prompt with it (the output starts inside the thought), Qwen3's template with
``enable_thinking: false`` ends the prompt with an empty think block (the output is all answer).
So whether an output starts inside its thought is read off each rendered prompt
(``starts_thinking``), not off the format's name: one rule serves every family and every
``chat_template_kwargs``.

``choose_reasoning(template, given)``: the operator's choice, else the format whose markers the
chat template writes (None when it writes none: no reasoning parser).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # the marker that opens the thought
    end: str  # the marker that closes it

    def starts_thinking(self, prompt: str) -> bool:
        """Whether an output of ``prompt`` begins inside the thought: the prompt's last
        marker (whitespace aside) opens one that it does not close."""
        tail = prompt.rstrip()
        start, end = tail.rfind(self.start), tail.rfind(self.end)
        return start >= 0 and start > end and not tail[start + len(self.start):].strip()


    def thought_closed(self, prompt: str) -> bool:
        """Whether ``prompt`` closed a thought as its last words: an empty think block that
        turns thinking off (Qwen3's ``enable_thinking: false``); the output is all answer."""
        return prompt.rstrip().endswith(self.end)  # DeepSeek V3.1's: a bare </think>


_THINK = ("<think>", "</think>")
FORMATS: dict[str, ReasoningFormat] = {
    name: ReasoningFormat(name, *markers) for name, markers in (
        ("qwen3", _THINK), ("deepseek_r1", _THINK), ("deepseek_v3", _THINK),
        ("kimi_k2", ("◁think▷", "◁/think▷")))}


def choose_reasoning(template: str | None, given: str | None = None
                     ) -> tuple[ReasoningFormat | None, str]:
    """The format to parse outputs with, and why (for the start-up log line)."""
    if given is not None:
        if given in ("none", ""):
            return None, "--reasoning-parser none"
        if given not in FORMATS:
            raise ValueError(f"unknown reasoning parser {given!r}; one of "
                             f"{', '.join(sorted(FORMATS))} or none")
        return FORMATS[given], f"--reasoning-parser {given}"
    if not template:
        return None, "no chat template"
    for fmt in FORMATS.values():
        if fmt.start in template and fmt.end in template:
            name = ("qwen3" if "enable_thinking" in template else
                    "deepseek_r1" if fmt.start == "<think>" else fmt.name)
            return FORMATS[name], f"the chat template writes {fmt.start} ... {fmt.end}"
    return None, "the chat template writes no thinking markers"
