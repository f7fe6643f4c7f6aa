"""Tool-call output formats: how a model writes a call, named as vLLM's ``--tool-call-parser``.

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3; kvserve's default): one block per call,
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``; xgrammar's ``qwen_3`` tag.
* ``llama3_json`` (Llama 3.1+): a bare JSON object per call, ``{"name": "f", "parameters":
  {...}}``, optionally after ``<|python_tag|>``; xgrammar's ``llama`` tag.

A format knows the strings that open a call (``markers``; of them, ``prefixes`` are written
before the call's JSON and are no part of it), where a call that starts at a marker ends
(``block_end``), how to read one block (``decode_block``) and how to write one
(``render_call``, for kvserve's default prompt). ``choose_format`` picks one for a chat
template when the operator names none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecodedCall:
    """One call read from the model's text: the function's name and its arguments object."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallFormat:
    name: str  # --tool-call-parser
    xgrammar_key: str  # xgrammar.get_model_structural_tag's model key
    markers: tuple[str, ...]  # strings that open a call
    prefixes: tuple[str, ...]  # markers written before the call's JSON object
    end_marker: str | None  # a block's closing string; None: a balanced JSON object ends it
    arguments_key: str  # the arguments' key when kvserve writes a call

    def render_call(self, name: str, arguments: Any) -> str:
        """A call as the model would write it (the default prompt shows past calls so)."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        if self.end_marker is None:
            return body
        return f"{self.markers[0]}\n{body}\n{self.end_marker}"

    def block_end(self, text: str) -> int | None:
        """``text`` starts with one of ``markers``: the length of the call block it opens, or
        None while the block is not complete yet."""
        if self.end_marker is not None:
            at = text.find(self.end_marker)
            return None if at < 0 else at + len(self.end_marker)
        prefix = self._prefix(text)
        start = len(prefix)
        while start < len(text) and text[start].isspace():
            start += 1
        if start == len(text):
            return None
        if text[start] != "{":
            return len(prefix)  # a prefix with no object after it: just text
        return json_object_end(text, start)

    def _prefix(self, text: str) -> str:
        return next((p for p in self.prefixes if text.startswith(p)), "")

    def decode_block(self, block: str) -> DecodedCall | None:
        """The call in one block (closed, or cut short by the end of the output), or None
        when it is not one: not JSON, no string ``name``, arguments not an object."""
        inner = block[len(self._prefix(block)):]
        if self.end_marker is not None and inner.rstrip().endswith(self.end_marker):
            inner = inner.rstrip()[:-len(self.end_marker)]
        try:
            obj = json.loads(inner.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return DecodedCall(obj["name"], args)


def json_object_end(text: str, start: int = 0) -> int | None:
    """The end (exclusive) of the JSON object or array opening at ``text[start]``, by bracket
    depth outside strings; None when it does not close within ``text``."""
    depth, in_str, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


HERMES = ToolCallFormat("hermes", "qwen_3", markers=("<tool_call>",), prefixes=("<tool_call>",),
                        end_marker="</tool_call>", arguments_key="arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "llama", markers=('{"name"', "<|python_tag|>"),
                             prefixes=("<|python_tag|>",), end_marker=None,
                             arguments_key="parameters")
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON)}
PARSER_NAMES = tuple(FORMATS)

_LLAMA_HINTS = re.compile(r'"parameters"|<\|python_tag\|>|ipython')


def choose_format(template: str | None, given: str | None = None) -> tuple[ToolCallFormat, str]:
    """The format to parse and constrain calls with, and why (for the start-up log): the one
    ``given`` (``--tool-call-parser``), else from the chat template: one that mentions
    ``<tool_call>`` is hermes, one that mentions ``"parameters"``, ``<|python_tag|>`` or
    ``ipython`` is llama3_json, anything else hermes (kvserve's default prompt format)."""
    if given is not None:
        if given not in FORMATS:
            raise ValueError(f"unknown tool-call parser {given!r}; one of "
                             f"{', '.join(PARSER_NAMES)}")
        return FORMATS[given], "--tool-call-parser"
    text = template or ""
    if "<tool_call>" in text:
        return HERMES, "the chat template writes <tool_call> blocks"
    if _LLAMA_HINTS.search(text):
        return LLAMA3_JSON, "the chat template writes Llama 3 JSON calls"
    return HERMES, "the chat template has no tool-call format of its own: kvserve's default"
