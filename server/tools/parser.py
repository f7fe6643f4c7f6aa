"""The model's text back into OpenAI tool calls, whole (``parse_tool_calls``) or as it streams
(``StreamingToolParser``); both give the same result for the same text.

For a format (``server.tools.formats``) and the request's tool names: a call is a block opened
by one of the format's markers that decodes to a known function name and an arguments object
(a block cut short by the end of the output counts when what it holds is complete JSON; a block
of several calls counts only if all of them do); any other block is plain text. ``content`` is
the text before the first call, trailing whitespace dropped (None when empty); text after the
first call that is not a call is dropped; with no call the content is the whole text.
While streaming, text that could still start a marker, and whitespace that could precede a
call, is held back until what follows decides it. ``names`` may carry the tools' parameter
schemas (``ToolSet.names``) to type untyped values (qwen3_coder). A format with a parser of
its own (``ToolCallFormat.parser_class``: harmony's ``HarmonyToolParser``) gets it from
``StreamingToolParser(fmt, names)``; it gives the analysis channel as reasoning
(``take_reasoning()``), not content."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

from server.tools.base import ToolCallFormat


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ToolCall, ...]
    reasoning: str | None = None  # a thought the format itself marks (harmony's analysis)


Event = str | ToolCall  # a content delta or a finished call


class StreamingToolParser:
    """Feed the output's text as it grows (``feed(delta)``), then ``finish()``; each returns
    the events that text settled: content deltas (str) and finished calls (ToolCall)."""

    own_content = False  # True: the content is what the parser gives, calls or none (harmony)

    def take_reasoning(self) -> str:
        """The thought read since the last call, for formats that mark one themselves (harmony's
        analysis channel); "" for the others."""
        return ""

    def __new__(cls, fmt: ToolCallFormat, names: Collection[str]) -> StreamingToolParser:
        own = fmt.parser_class
        if cls is StreamingToolParser and own is not None:
            cls = own
        return super().__new__(cls)

    def __init__(self, fmt: ToolCallFormat, names: Collection[str]) -> None:
        self.fmt = fmt
        self.schemas = getattr(names, "schemas", None)
        self.names = frozenset(names)
        self._buf = ""  # text not yet settled
        self._ws = ""  # trailing whitespace of the content, held until what follows is known
        self.called = False  # a call was found: from here on only calls are emitted

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        out = self._drain(final=True)
        if not self.called and self._ws:
            out.append(self._ws)
        self._ws = ""
        return out

    def _text(self, text: str, out: list[Event]) -> None:
        if self.called or not text:
            return
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            out.append(body)

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            buf = self._buf
            at = _first_marker(buf, self.fmt.markers)
            if at < 0:
                keep = 0 if final else _partial_marker(buf, self.fmt.markers)
                self._text(buf[:len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                break
            self._text(buf[:at], out)
            end = self.fmt.block_end(buf[at:])
            if end is None and not final:
                self._buf = buf[at:]
                break
            block = buf[at:] if end is None else buf[at:at + end]
            self._buf = buf[at + len(block):]
            calls = self._calls(block)
            if not calls:
                self._text(block, out)
            else:
                self._ws = ""
                self.called = True
                out.extend(calls)
        return out

    def _calls(self, block: str) -> list[ToolCall]:
        """The block's calls; none unless every call in it names a known function."""
        decoded = self.fmt.decode_calls(block, self.schemas)
        if not decoded or any(d.name not in self.names for d in decoded):
            return []
        return [ToolCall(d.name, json.dumps(d.arguments, ensure_ascii=False)) for d in decoded]


def _first_marker(text: str, markers: tuple[str, ...]) -> int:
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else -1


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that a marker starts with (not all of it)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-k:]):
                best = k
                break
    return best


def parse_tool_calls(text: str, fmt: ToolCallFormat, names: Collection[str]) -> ParsedOutput:
    """A finished output's content and calls (see the module's rules)."""
    parser = StreamingToolParser(fmt, names)
    events = parser.feed(text) + parser.finish()
    calls = tuple(e for e in events if isinstance(e, ToolCall))
    if not calls and not parser.own_content:
        return ParsedOutput(text, ())
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedOutput(content or None, calls, parser.take_reasoning() or None)


def reads_channels(fmt: ToolCallFormat) -> bool:
    """Whether ``fmt``'s outputs are parsed even without tools: its messages mark their own
    channels (harmony's analysis and final), so the content is only the final channel's."""
    return bool(getattr(fmt.parser_class, "own_content", False))
