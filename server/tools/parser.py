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
(``take_reasoning()``), not content.

``incremental=True`` (what ``/v1/chat/completions`` uses) gives OpenAI's view of calls as they
are written: a call whose format has a head (``ToolCallFormat.call_head``: hermes,
llama3_json, mistral's lone object and v11 form) opens (``CallStart``) once its name is written
and known, and its arguments' object text follows as it grows (``ArgumentsDelta``: the model's
text, control characters in strings escaped; the pieces concatenate to the call's arguments);
other calls come whole (``ToolCall``, arguments re-serialised). A block cut short by the end of
the output is never content: a call already open stays as far as it was written (its arguments
possibly incomplete JSON), one whose name was not yet known is dropped (``dropped``), as is a
cut block of a headless format that does not decode whole. Without it, a cut block that does
not decode is content and calls come whole only."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

from server.tools.base import ToolCallFormat
from server.tools.partial import ArgumentsText, CallHead


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: tuple[ToolCall, ...]
    reasoning: str | None = None  # a thought the format itself marks (harmony's analysis)


@dataclass(frozen=True)
class CallStart:
    """A call opened (incremental parsing): its name; its arguments follow as
    ``ArgumentsDelta`` events until the next call or the end."""

    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """The next piece of the open call's arguments text (incremental parsing)."""

    text: str


# A content delta, a finished call, or (incremental parsing) a call's start or arguments piece.
Event = str | ToolCall | CallStart | ArgumentsDelta


class _OpenCall:
    """The call being written (incremental parsing): its head, how much of its block's
    arguments text was read, and that text's reader (None until the value is known to be an
    object)."""

    def __init__(self, head: CallHead) -> None:
        self.head = head
        self.read = 0  # characters of the block from head.arguments_at fed to ``text``
        self.text: ArgumentsText | None = None


class StreamingToolParser:
    """Feed the output's text as it grows (``feed(delta)``), then ``finish()``; each returns
    the events that text settled: content deltas (str) and finished calls (ToolCall)."""

    own_content = False  # True: the content is what the parser gives, calls or none (harmony)

    def take_reasoning(self) -> str:
        """The thought read since the last call, for formats that mark one themselves (harmony's
        analysis channel); "" for the others."""
        return ""

    def __new__(cls, fmt: ToolCallFormat, names: Collection[str],
                incremental: bool = False) -> StreamingToolParser:
        own = fmt.parser_class
        if cls is StreamingToolParser and own is not None:
            cls = own
        return super().__new__(cls)

    def __init__(self, fmt: ToolCallFormat, names: Collection[str],
                 incremental: bool = False) -> None:
        self.fmt = fmt
        self.incremental = incremental
        self._open: _OpenCall | None = None  # the call being written (incremental)
        self.dropped = False  # a cut block was dropped (incremental): not content, no call
        self.schemas = getattr(names, "schemas", None)
        self.names = frozenset(names)
        self._buf = ""  # text not yet settled
        self._ws = ""  # trailing whitespace of the content, held until what follows is known
        self.called = False  # a call was found: from here on only calls are emitted

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self, cut: bool = False) -> list[Event]:
        """The events the end of the output settles; ``cut``: it was cut short (``max_tokens``),
        so that incrementally a marker cut short at its end is dropped too, not content."""
        out = self._drain(final=True, cut=cut and self.incremental)
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

    def _drain(self, final: bool, cut: bool = False) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            buf = self._buf
            at = _first_marker(buf, self.fmt.markers)
            if at < 0:
                keep = 0 if final and not cut else _partial_marker(buf, self.fmt.markers)
                self._text(buf[:len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                if final and self._buf:  # cut inside a marker
                    self._buf, self._ws, self.dropped = "", "", True
                break
            self._text(buf[:at], out)
            end = self.fmt.block_end(buf[at:])
            if end is None and not final:
                self._buf = buf[at:]
                if self.incremental:
                    self._stream(self._buf, out)
                break
            block = buf[at:] if end is None else buf[at:at + end]
            self._buf = buf[at + len(block):]
            if self.incremental:
                self._block(block, end is None, out)
                continue
            calls = self._calls(block)
            if not calls:
                self._text(block, out)
            else:
                self._ws = ""
                self.called = True
                out.extend(calls)
        return out

    def _stream(self, block: str, out: list[Event]) -> None:
        """Incremental: open the call ``block`` (unfinished, or just finished) writes once its
        name is known, and pass on its arguments' new text while the value is an object."""
        call = self._open
        if call is None:
            head = self.fmt.call_head(block)
            if head is None or head.name not in self.names:
                return
            call = self._open = _OpenCall(head)
            self._ws = ""
            self.called = True
            out.append(CallStart(head.name))
        if call.head.arguments_at is None:
            head = self.fmt.call_head(block)
            if head is None or head.arguments_at is None:
                return
            call.head = head
        at = call.head.arguments_at
        if call.read == 0 and block[at:at + 1] == "{":
            call.text = ArgumentsText()
        if call.text is None:
            return
        piece = call.text.feed(block[at + call.read:])
        call.read = len(block) - at
        if piece:
            out.append(ArgumentsDelta(piece))

    def _block(self, block: str, cut: bool, out: list[Event]) -> None:
        """Incremental: a block that ended (``cut``: by the end of the output)."""
        if self._open is None and not cut:
            calls = self._calls(block)
            if not calls:
                self._text(block, out)
                return
            head = self.fmt.call_head(block)
            if len(calls) > 1 or head is None or head.name != calls[0].name:
                self._ws = ""
                self.called = True
                out.extend(calls)  # read whole: no head
                return
        self._stream(block, out)
        call, self._open = self._open, None
        if call is None:  # cut before its name was known, or a headless format's block
            calls = self._calls(block)
            if calls:  # complete JSON after all
                self._ws, self.called = "", True
                out.extend(calls)
            else:
                self._ws, self.dropped = "", True
            return
        if call.text is not None or call.head.arguments_at is None:
            return
        # the arguments are not an object (a JSON string, say): read whole when they decode
        calls = self._calls(block)
        if calls and calls[0].arguments:
            out.append(ArgumentsDelta(calls[0].arguments))

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


def parse_tool_calls(text: str, fmt: ToolCallFormat, names: Collection[str],
                     incremental: bool = False, cut: bool = False) -> ParsedOutput:
    """A finished output's content and calls (see the module's rules); ``incremental``: read
    as the incremental parser streams it, so the calls are what a stream's deltas add up to
    (a cut call included, its arguments as far as written); ``cut``: the output was cut short
    (``StreamingToolParser.finish``)."""
    parser = StreamingToolParser(fmt, names, incremental=incremental)
    events = parser.feed(text) + parser.finish(cut)
    calls = collect_calls(events)
    if not calls and not parser.own_content and not parser.dropped:
        return ParsedOutput(text, ())
    content = "".join(e for e in events if isinstance(e, str))
    return ParsedOutput(content or None, calls, parser.take_reasoning() or None)


def collect_calls(events: list[Event]) -> tuple[ToolCall, ...]:
    """The calls that ``events`` make up: whole ones, and each started one with its arguments
    pieces joined."""
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ToolCall):
            calls.append(e)
        elif isinstance(e, CallStart):
            calls.append(ToolCall(e.name, ""))
        elif isinstance(e, ArgumentsDelta):
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + e.text)
    return tuple(calls)


def reads_channels(fmt: ToolCallFormat) -> bool:
    """Whether ``fmt``'s outputs are parsed even without tools: its messages mark their own
    channels (harmony's analysis and final), so the content is only the final channel's."""
    return bool(getattr(fmt.parser_class, "own_content", False))
