"""The base of the tool-call formats (``server.tools.formats`` lists them): a call read from
the model's text (``DecodedCall``) and a format (``ToolCallFormat``), with the JSON helpers the
formats share. A format knows the strings that open a call (``markers``; of them, ``prefixes``
are written before the call's JSON and are no part of it), where a call block that starts at a
marker ends (``block_end``), how to read one block (``decode_calls``: a block may hold several
calls; ``schemas``, the request's tools' parameter schemas by name, types the raw values of
formats that write them untyped) and how to write a message's calls (``render_calls``, for
kvserve's default prompt). Hooks a format may override: ``structural_tag`` (its own constraint
instead of xgrammar's built-in tag), ``how_to_call`` (the default prompt's instruction),
``template_arguments`` (a past call's arguments as the chat template takes them),
``for_template`` (the format as a given chat template writes it), ``call_head`` (a call's
name and where its arguments start, read while the call is written, for formats whose
arguments can stream: server/tools/partial.py) and
``parser_class`` (a parser of its own instead of the marker-and-block one).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.tools.partial import CallHead, json_call_head

Schemas = Mapping[str, Mapping[str, Any]]  # a request's tools' parameter schemas, by name


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

    def call_head(self, block: str) -> CallHead | None:
        """The head of the call that ``block`` (starting at a marker, possibly unfinished)
        opens: its name once written, and where its arguments' JSON value starts; None until
        the name is known, and always for a format whose calls do not write the name first and
        then the arguments as one JSON object (arrays of calls, XML, DeepSeek's blocks: their
        calls are read whole). The default reads a ``{"name", "arguments" | "parameters"}``
        object after the prefix."""
        return json_call_head(block, len(self._prefix(block)))

    def structural_tag(self, tools: Any) -> Any | None:
        """The constraint for a ``ToolSet`` (``calls_expected``), if the format builds its own
        (an ``xgrammar.structural_tag.StructuralTag``); None: xgrammar's tag for
        ``xgrammar_key``."""
        return None

    def how_to_call(self) -> str | None:
        """The default prompt's instruction (``{example}`` stands for a call), if the format
        has its own; None: server.tools.prompt's for JSON calls."""
        return None

    def template_arguments(self, arguments: str) -> Any:
        """A past call's arguments (their JSON text) as the chat template gets them: where the
        text holds an object, a dict, as HF templates expect (else the text)."""
        value = _json(arguments)
        return value if isinstance(value, dict) else arguments

    def for_template(self, template: str) -> ToolCallFormat:
        """The format as the chat template ``template`` (its text) writes it: itself, unless
        the template decides a detail (DeepSeek's arguments as text or as a dict)."""
        return self

    @property
    def parser_class(self) -> type | None:
        """A ``StreamingToolParser`` subclass that reads this format's outputs, if the
        marker-and-block one does not (harmony's channels); None: that one."""
        return None

    def _prefix(self, text: str) -> str:
        return next((p for p in self.prefixes if text.startswith(p)), "")

    def decode_calls(self, block: str, schemas: Schemas | None = None
                     ) -> tuple[DecodedCall, ...] | None:
        """The calls in one block (closed, or cut short by the end of the output), or None
        when it is not a call: not JSON, no string ``name``, arguments not an object."""
        inner = block[len(self._prefix(block)):]
        if self.end_marker is not None and inner.rstrip().endswith(self.end_marker):
            inner = inner.rstrip()[:-len(self.end_marker)]
        call = decode_call_object(_json(inner.strip()))
        return None if call is None else (call,)


_NOT_JSON = object()


def _json(text: str) -> Any:
    """``text`` as JSON (raw control characters allowed inside strings: xgrammar lets a string
    with a ``maxLength`` hold them), or ``_NOT_JSON``."""
    try:
        return json.loads(text, strict=False)
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
