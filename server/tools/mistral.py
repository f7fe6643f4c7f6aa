"""``mistral`` (Mistral, Mixtral, Mistral Nemo/Small): ``[TOOL_CALLS]`` and then either a JSON
array of calls, ``[{"name": "f", "arguments": {...}}, ...]`` (tokenizers before v11; one block,
several calls), or, from tokenizer v11 on, ``name[ARGS]{...}`` (one ``[TOOL_CALLS]`` per call;
an ``[CALL_ID]id`` before ``[ARGS]`` is skipped); see server/tools/formats.py.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from server.tools.base import (
    DecodedCall,
    Schemas,
    ToolCallFormat,
    _json,
    decode_call_object,
    json_object_end,
)
from server.tools.partial import CallHead

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

    def call_head(self, block: str) -> CallHead | None:
        """A lone call object's head, or v11's ``name[ARGS]{`` once its ``{`` is written; None
        for an array of calls (read whole)."""
        start = len(self._prefix(block))
        while start < len(block) and block[start].isspace():
            start += 1
        if block[start:start + 1] in ("[", ""):
            return None
        if block[start] == "{":
            return super().call_head(block)
        at = self._v11_arguments(block, start)
        if at is None or at < 0:
            return None
        return CallHead(_NAME_CHARS.match(block, start).group(), at)

    def decode_calls(self, block: str, schemas: Schemas | None = None
                     ) -> tuple[DecodedCall, ...] | None:
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


MISTRAL = MistralFormat("mistral", None, markers=("[TOOL_CALLS]",), prefixes=("[TOOL_CALLS]",),
                        end_marker=None, arguments_key="arguments", special_marker=True)
MISTRAL_V11 = MistralFormat("mistral", None, markers=("[TOOL_CALLS]",),
                            prefixes=("[TOOL_CALLS]",), end_marker=None,
                            arguments_key="arguments", special_marker=True, v11=True)
