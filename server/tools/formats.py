"""Tool-call output formats: how a model writes a call, named as vLLM's ``--tool-call-parser``.

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3; kvserve's default): one block per call,
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``; xgrammar's ``qwen_3`` tag.
* ``llama3_json`` (Llama 3.1+): a bare JSON object per call, ``{"name": "f", "parameters":
  {...}}``, optionally after ``<|python_tag|>``; xgrammar's ``llama`` tag.
* ``mistral`` (Mistral, Mixtral, Mistral Nemo/Small): ``[TOOL_CALLS]`` and then either a JSON
  array of calls, ``[{"name": "f", "arguments": {...}}, ...]`` (tokenizers before v11; one
  block, several calls), or, from tokenizer v11 on, ``name[ARGS]{...}`` (one ``[TOOL_CALLS]``
  per call; an ``[CALL_ID]id`` before ``[ARGS]`` is skipped). Both are parsed whichever the
  model writes; kvserve writes and constrains the form the chat template shows (``[ARGS]`` in
  it: v11, else the array). xgrammar has no tag for it: server/tools/constraint.py builds one.
  ``[TOOL_CALLS]`` is a special token, so the output is decoded with special tokens kept.

A format knows the strings that open a call (``markers``; of them, ``prefixes`` are written
before the call's JSON and are no part of it), where a call block that starts at a marker
ends (``block_end``), how to read one block (``decode_calls``: a block may hold several
calls) and how to write a message's calls (``render_calls``, for kvserve's default prompt).
``choose_format`` picks one for a chat template when the operator names none.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
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
    xgrammar_key: str | None  # xgrammar.get_model_structural_tag's model key; None: kvserve's
    markers: tuple[str, ...]  # strings that open a call
    prefixes: tuple[str, ...]  # markers written before the call's JSON object
    end_marker: str | None  # a block's closing string; None: a balanced JSON object ends it
    arguments_key: str  # the arguments' key when kvserve writes a call
    special_marker: bool = False  # the marker is a special token: keep them when decoding

    def render_call(self, name: str, arguments: Any) -> str:
        """A call as the model would write it (the default prompt shows past calls so)."""
        body = json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
        if self.end_marker is None:
            return body
        return f"{self.markers[0]}\n{body}\n{self.end_marker}"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """A message's calls, ``(name, arguments)`` each, as the model would write them."""
        return "\n".join(self.render_call(name, args) for name, args in calls)

    def call_id(self) -> str:
        """A new call's id for the response."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def template_call_id(self, call_id: str) -> str:
        """A past call's id as the chat template gets it."""
        return call_id

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

    def decode_calls(self, block: str) -> tuple[DecodedCall, ...] | None:
        """The calls in one block (closed, or cut short by the end of the output), or None
        when it is not a call: not JSON, no string ``name``, arguments not an object."""
        inner = block[len(self._prefix(block)):]
        if self.end_marker is not None and inner.rstrip().endswith(self.end_marker):
            inner = inner.rstrip()[:-len(self.end_marker)]
        call = decode_call_object(_json(inner.strip()))
        return None if call is None else (call,)


_NOT_JSON = object()


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


def decode_call_object(obj: Any) -> DecodedCall | None:
    """``{"name": str, "arguments" | "parameters": object or its JSON text}`` as a call (no
    arguments: ``{}``), or None when ``obj`` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _json(args)
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


_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")
_ALNUM_RUN = re.compile(r"[A-Za-z0-9]*")
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")
MAX_NAME = 64  # a function name's most characters (server.tools.request)


@dataclass(frozen=True)
class MistralFormat(ToolCallFormat):
    """``[TOOL_CALLS]`` then a JSON array of calls, or (``v11``) ``name[ARGS]{...}`` per call;
    see the module's docstring. Past calls' ids reach the template as Mistral's 9 letters and
    digits (its templates refuse others), and new calls get such ids."""

    v11: bool = False  # write and constrain ``[TOOL_CALLS]name[ARGS]{...}``

    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def render_call(self, name: str, arguments: Any) -> str:
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        marker = self.markers[0]
        if self.v11:
            return "".join(f"{marker}{name}{self.ARGS}{json.dumps(args, ensure_ascii=False)}"
                           for name, args in calls)
        return marker + json.dumps([{"name": name, "arguments": args} for name, args in calls],
                                   ensure_ascii=False)

    def call_id(self) -> str:
        return uuid.uuid4().hex[:9]

    def template_call_id(self, call_id: str) -> str:
        """The id's last 9 letters and digits (zero-padded): the same id maps the same way in
        the assistant's call and the tool's answer."""
        return _NOT_ALNUM.sub("", call_id)[-9:].rjust(9, "0")

    def block_end(self, text: str) -> int | None:
        marker = self._prefix(text)
        start = len(marker)
        while start < len(text) and text[start].isspace():
            start += 1
        if start == len(text):
            return None
        if text[start] in "[{":  # the JSON array of calls (or one call object)
            return json_object_end(text, start)
        at = self._v11_arguments(text, start)
        if at is None:
            return None
        if at < 0:
            return len(marker)  # the marker with no call after it: just text
        return json_object_end(text, at)

    def _v11_arguments(self, text: str, start: int) -> int | None:
        """Where the arguments object of ``name([CALL_ID]id)?([ARGS])?{`` at ``start`` opens;
        None while ``text`` may still become one, -1 when it cannot."""
        i = _NAME_CHARS.match(text, start).end()
        if i - start > MAX_NAME:
            return -1
        if i == len(text):
            return None
        if i == start:
            return -1
        for tag, tail in ((self.CALL_ID, _ALNUM_RUN), (self.ARGS, None)):
            rest = text[i:i + len(tag)]
            if tag.startswith(rest) and len(rest) < len(tag):
                return None  # a tag cut short
            if rest == tag:
                i = len(tag) + i if tail is None else tail.match(text, i + len(tag)).end()
                if i == len(text):
                    return None
        return i if text[i] == "{" else -1

    def decode_calls(self, block: str) -> tuple[DecodedCall, ...] | None:
        inner = block[len(self._prefix(block)):].strip()
        if inner[:1] in ("[", "{"):
            obj = _json(inner)
            items = obj if isinstance(obj, list) else [obj]
            calls = tuple(c for c in map(decode_call_object, items) if c is not None)
            return calls if calls and len(calls) == len(items) else None
        at = self._v11_arguments(inner, 0)
        if at is None or at < 0:
            return None
        name = _NAME_CHARS.match(inner).group()
        args = _json(inner[at:])
        return (DecodedCall(name, args),) if isinstance(args, dict) else None


HERMES = ToolCallFormat("hermes", "qwen_3", markers=("<tool_call>",), prefixes=("<tool_call>",),
                        end_marker="</tool_call>", arguments_key="arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", "llama", markers=('{"name"', "<|python_tag|>"),
                             prefixes=("<|python_tag|>",), end_marker=None,
                             arguments_key="parameters")
MISTRAL = MistralFormat("mistral", None, markers=("[TOOL_CALLS]",), prefixes=("[TOOL_CALLS]",),
                        end_marker=None, arguments_key="arguments", special_marker=True)
MISTRAL_V11 = MistralFormat("mistral", None, markers=("[TOOL_CALLS]",),
                            prefixes=("[TOOL_CALLS]",), end_marker=None,
                            arguments_key="arguments", special_marker=True, v11=True)
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
PARSER_NAMES = tuple(FORMATS)

_LLAMA_HINTS = re.compile(r'"parameters"|<\|python_tag\|>|ipython')


def choose_format(template: str | None, given: str | None = None) -> tuple[ToolCallFormat, str]:
    """The format to parse and constrain calls with, and why (for the start-up log): the one
    ``given`` (``--tool-call-parser``), else from the chat template: one that mentions
    ``[TOOL_CALLS]`` is mistral, ``<tool_call>`` hermes, ``"parameters"``, ``<|python_tag|>``
    or ``ipython`` llama3_json, anything else hermes (kvserve's default prompt format).
    Mistral writes ``name[ARGS]{...}`` calls when the template mentions ``[ARGS]``."""
    if given is not None and given not in FORMATS:
        raise ValueError(f"unknown tool-call parser {given!r}; one of {', '.join(PARSER_NAMES)}")
    text = template or ""
    if given == "mistral" or (given is None and "[TOOL_CALLS]" in text):
        v11 = "[ARGS]" in text
        return (MISTRAL_V11 if v11 else MISTRAL), (
            ("--tool-call-parser" if given else "the chat template writes [TOOL_CALLS]")
            + (", calls as name[ARGS]{...} (the template writes [ARGS])" if v11 else ""))
    if given is not None:
        return FORMATS[given], "--tool-call-parser"
    if "<tool_call>" in text:
        return HERMES, "the chat template writes <tool_call> blocks"
    if _LLAMA_HINTS.search(text):
        return LLAMA3_JSON, "the chat template writes Llama 3 JSON calls"
    return HERMES, "the chat template has no tool-call format of its own: kvserve's default"
