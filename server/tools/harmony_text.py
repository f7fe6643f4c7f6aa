"""Reading OpenAI's harmony format (gpt-oss) from an output's text: its messages, each a
channel, an optional recipient and a body (server/tools/harmony.py describes the format and
its constraint). ``HarmonyReader`` reads a stream into body deltas and finished messages;
``read_messages`` and ``split_output`` read a whole output.

``openai-harmony``'s ``StreamableParser`` reads the same messages from harmony token ids, but it
needs its o200k vocabulary file (downloaded on first use, ``TIKTOKEN_ENCODINGS_BASE`` offline)
and gpt-oss's own token ids, while kvserve's parsers read the detokenised text of any tokenizer;
so the messages are read from the text here, and tests/server/tools/test_tool_formats_harmony.py checks
this reader against ``StreamableParser`` where the vocabulary loads.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from server.tools.base import DecodedCall, _json

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
_TERMINATORS = (END, CALL, RETURN, START)
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
FUNCTIONS = "functions."
NEXT = f"{START}assistant"


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    content: str


def call_of(message: HarmonyMessage) -> DecodedCall | None:
    """The call a message makes (to ``functions.NAME``, an arguments object), if any."""
    if not message.recipient or not message.recipient.startswith(FUNCTIONS):
        return None
    args = _json(message.content.strip() or "{}")
    if not isinstance(args, dict):
        return None
    return DecodedCall(message.recipient[len(FUNCTIONS):], args)


def parse_header(header: str) -> tuple[str | None, str | None]:
    """``(channel, recipient)`` of a message's header (the text before ``<|message|>``)."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


def read_messages(text: str) -> list[HarmonyMessage]:
    """The messages of a whole output (see ``HarmonyReader``)."""
    reader = HarmonyReader()
    events = reader.feed(text) + reader.finish()
    return [e for e in events if isinstance(e, HarmonyMessage)]


def _partial(text: str) -> int:
    """The length of the longest end of ``text`` that a marker starts with (not all of it)."""
    at = text.rfind("<", max(0, len(text) - max(map(len, _MARKERS)) + 1))
    if at < 0:
        return 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) and m != tail for m in _MARKERS) else 0


class HarmonyReader:
    """Reads an output as it streams: ``feed(delta)`` and ``finish()`` return events, each a
    ``(channel, recipient, text)`` delta of a message's body (a tuple) or a finished
    ``HarmonyMessage``. Text before any header comes as a delta with channel None."""

    def __init__(self) -> None:
        self._buf = ""
        self._header: str | None = ""  # the header being read; None: inside a body
        self._channel: str | None = None
        self._recipient: str | None = None
        self._body = ""
        self._bare = True  # no header seen yet: text may be plain content

    def feed(self, delta: str) -> list[Any]:
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[Any]:
        out = self._drain(final=True)
        if self._header is None:
            out.append(self._close())
        elif self._header.strip() and self._bare:
            out.append((None, None, self._header))  # never a header: plain text
        self._header = ""
        return out

    def _close(self) -> HarmonyMessage:
        msg = HarmonyMessage(self._channel, self._recipient, self._body)
        self._header, self._channel, self._recipient, self._body = "", None, None, ""
        return msg

    def _drain(self, final: bool) -> list[Any]:
        out: list[Any] = []
        while self._buf:
            buf = self._buf
            if self._header is not None:  # reading a header
                at = buf.find(MESSAGE)
                if at < 0:
                    keep = 0 if final else _partial(buf)
                    self._header += buf[:len(buf) - keep]
                    self._buf = buf[len(buf) - keep:]
                    break
                header = self._header + buf[:at]
                self._buf = buf[at + len(MESSAGE):]
                self._header = None
                self._bare = False
                self._channel, self._recipient = parse_header(header)
                continue
            ends = [(i, m) for m in _TERMINATORS if (i := buf.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                piece = buf[:at]
                self._buf = buf[at + (0 if marker == START else len(marker)):]
            else:
                keep = 0 if final else _partial(buf)
                piece = buf[:len(buf) - keep]
                self._buf = buf[len(buf) - keep:]
            if piece:
                self._body += piece
                out.append((self._channel, self._recipient, piece))
            if not ends:
                break
            out.append(self._close())
            if self._buf.startswith(START):
                self._buf = self._buf[len(START):]
        return out


def split_output(text: str, names: Collection[str]
                 ) -> tuple[str | None, str | None, tuple[DecodedCall, ...]]:
    """``(reasoning, content, calls)`` of a whole harmony output: the analysis channel's text,
    the final (and recipient-less commentary) text, and the calls to ``names``; None for an
    empty reasoning or content."""
    reader = HarmonyReader()
    events = reader.feed(text) + reader.finish()
    reasoning, content, calls = [], [], []
    for e in events:
        if isinstance(e, HarmonyMessage):
            call = call_of(e)
            if call is not None and call.name in names:
                calls.append(call)
        elif e[0] == "analysis":
            reasoning.append(e[2])
        elif e[1] is None:
            content.append(e[2])
    return "".join(reasoning) or None, "".join(content) or None, tuple(calls)
