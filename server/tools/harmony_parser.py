"""``HarmonyToolParser``: harmony's messages (server/tools/harmony_text.py) as the streaming tool
parser's events: the final channel's text (and a recipient-less commentary's) as content
deltas, each call to a known function once its message ends; the analysis channel's text is
kept for ``take_reasoning()``, which the endpoints send as reasoning."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from server.tools.base import ToolCallFormat
from server.tools.harmony_text import HarmonyMessage, HarmonyReader, call_of
from server.tools.parser import Event, StreamingToolParser, ToolCall


class HarmonyToolParser(StreamingToolParser):
    own_content = True  # its content is the final channel's, calls or none

    def __init__(self, fmt: ToolCallFormat, names: Collection[str],
                 incremental: bool = False) -> None:
        super().__init__(fmt, names, incremental)  # calls come whole either way
        self._reader = HarmonyReader()
        self._reasoning: list[str] = []

    def take_reasoning(self) -> str:
        """The analysis text read since the last call."""
        text, self._reasoning = "".join(self._reasoning), []
        return text

    def feed(self, delta: str) -> list[Event]:
        return self._events(self._reader.feed(delta))

    def finish(self, cut: bool = False) -> list[Event]:
        return self._events(self._reader.finish())

    def _events(self, read: list[Any]) -> list[Event]:
        out: list[Event] = []
        for e in read:
            if isinstance(e, HarmonyMessage):
                call = call_of(e)
                if call is not None and call.name in self.names:
                    self.called = True
                    out.append(ToolCall(call.name, json.dumps(call.arguments,
                                                              ensure_ascii=False)))
            elif e[0] == "analysis":
                self._reasoning.append(e[2])
            elif e[1] is None:
                out.append(e[2])
        return out
