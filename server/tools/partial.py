"""Reading a call while it is being written: its head (``CallHead``: the function's name, and
where the arguments' JSON value starts) and its arguments' text as it grows
(``ArgumentsText``), for the formats that write a call's name before its arguments and the
arguments as one JSON object in order (hermes, llama3_json, mistral's v11 form).

``ArgumentsText`` passes the object's text through as written, up to and including its closing
brace, with one change: a raw control character inside a string (xgrammar lets a string with a
``maxLength`` hold them; ``json.loads(strict=False)`` reads them) is written as its JSON escape,
so that the text is strict JSON once the object closes, and a prefix of it before."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


@dataclass(frozen=True)
class CallHead:
    """A call's name (complete), and the offset in its block where the arguments' JSON value
    starts (its first character is there), or None while that is not known yet."""

    name: str
    arguments_at: int | None


def json_call_head(text: str, start: int) -> CallHead | None:
    """The head of a ``{"name": ..., "arguments" | "parameters": ...}`` object opening at
    ``text[start]`` (whitespace before it allowed): None until the name's string has closed
    (or when the text is no such object); ``arguments_at`` None until the value's first
    character is in ``text``."""
    m = _NAME.match(text, start)
    if m is None:
        return None
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    a = _ARGUMENTS.match(text, m.end())
    at = a.end() if a is not None and a.end() < len(text) else None
    return CallHead(name, at)


class ArgumentsText:
    """The text of one JSON object, fed as it is written (``feed``): returns the part of each
    piece that belongs to the object (nothing once it has closed: ``closed``), control
    characters inside strings escaped (see the module's docstring)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.closed = False

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            if self.closed:
                break
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                elif ch < " ":
                    ch = _ESCAPES.get(ch, f"\\u{ord(ch):04x}")
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.closed = self.depth == 0
            out.append(ch)
        return "".join(out)
