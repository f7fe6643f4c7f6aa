"""The message object of the Messages API, whole (``MessageDraft.message``) or as Anthropic's
stream of typed events (``MessageEvents``).

``content``: a ``thinking`` block first when the output has a thought (its ``signature`` an
opaque digest this server never checks; empty with ``thinking.display: "omitted"``), a ``text``
block with the answer (the text before the first tool call; none when empty), a ``tool_use``
block per call (``toolu_`` ids, ``input`` the parsed arguments). ``stop_reason``: ``tool_use``,
``max_tokens``, ``model_context_window_exceeded``, ``stop_sequence`` (with ``stop_sequence``)
or ``end_turn``. ``usage``: ``input_tokens`` (not served by the prefix cache),
``cache_read_input_tokens``, ``cache_creation_input_tokens`` (always 0), ``output_tokens``.
A stream: ``message_start`` and ``ping`` once the first output is in; per block
``content_block_start``, its deltas (``thinking_delta`` then one ``signature_delta``;
``text_delta``; one ``input_json_delta`` with a call's whole arguments) and
``content_block_stop``; then ``message_delta`` (stop reason, final usage) and ``message_stop``;
a failure mid-way is an ``error`` event in Anthropic's error shape."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.request_output import RequestOutput
from server.anthropic.errors import error_body
from server.errors import APIError
from server.reasoning.formats import ReasoningFormat
from server.reasoning.splitter import ReasoningSplitter
from server.sse import dumps
from server.tools.formats import ToolCallFormat
from server.tools.parser import StreamingToolParser, ToolCall, parse_tool_calls
from server.tools.request import ToolSet


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def signature(thought: str) -> str:
    """The opaque ``signature`` of a thinking block (Anthropic's clients keep and send it
    back; this server ignores it)."""
    return "kvserve-" + hashlib.sha256(thought.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
            "input": json.loads(call.arguments)}


def usage(out: RequestOutput) -> dict[str, Any]:
    cached = out.num_cached_tokens or 0
    return {"input_tokens": len(out.prompt_token_ids) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": sum(len(c.token_ids) for c in out.outputs)}


@dataclass
class MessageDraft:
    """What a message repeats of its request, and how its parts are read off the output."""

    id: str
    model: str
    stop_sequences: list[str]
    tools: ToolSet | None  # calls parsed out of the output; None: none expected
    fmt: ToolCallFormat
    reasoning: ReasoningFormat | None = None  # the thought parsed out first; None: none
    thinking: bool = False  # the output starts inside the thought (ChatPrompt.thinking)
    show_thinking: bool = True  # thinking blocks are sent (not with thinking disabled)
    omit_thinking: bool = False  # thinking.display "omitted": the blocks' thought left empty
    window_bound: bool = False  # max_tokens was cut to the room left in the context window

    def splitter(self) -> ReasoningSplitter | None:
        return ReasoningSplitter(self.reasoning, self.thinking) if self.reasoning else None

    def stop(self, out: RequestOutput, called: bool) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence``."""
        c = out.outputs[0]
        if c.finish_reason == "length":
            return ("model_context_window_exceeded" if self.window_bound else "max_tokens"), None
        if called:
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stop_sequences:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def body(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             use: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": use}

    def message(self, out: RequestOutput) -> dict[str, Any]:
        """The whole message of a finished output."""
        text, content = out.outputs[0].text, []
        splitter = self.splitter()
        if splitter is not None:
            thought, text = splitter.split(text)
            if thought is not None and self.show_thinking:
                content.append({"type": "thinking",
                                "thinking": "" if self.omit_thinking else thought,
                                "signature": signature(thought)})
        calls: tuple[ToolCall, ...] = ()
        if self.tools is not None:
            parsed = parse_tool_calls(text, self.fmt, self.tools.names)
            text, calls = parsed.content or "", parsed.calls
        if text:
            content.append({"type": "text", "text": text})
        content += [tool_use_block(call) for call in calls]
        return self.body(content, self.stop(out, bool(calls)), usage(out))


class MessageEvents:
    """The event stream of one message (``deltas`` / ``closing`` / ``failed`` for
    server.serving.stream_events)."""

    def __init__(self, draft: MessageDraft) -> None:
        self.draft = draft
        self.started = False
        self.index = 0  # the next block's index
        self.open: str | None = None  # the kind of the open block
        self.sent = 0
        self.thought = ""
        self.calls = 0
        tools = draft.tools
        self.parser = StreamingToolParser(draft.fmt, tools.names) if tools is not None else None
        self.splitter = draft.splitter()

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n"

    def _start(self, out: RequestOutput) -> Iterator[str]:
        self.started = True
        use = {**usage(out), "output_tokens": 0}
        yield self._event("message_start", message=self.draft.body([], (None, None), use))
        yield self._event("ping")

    def deltas(self, _: int, out: RequestOutput) -> Iterator[str]:
        if not self.started:
            yield from self._start(out)
        c = out.outputs[0]
        new, self.sent = c.text[self.sent:], len(c.text)
        finished = c.finish_reason is not None
        if self.splitter is not None:
            thought, new = self.splitter.feed(new)
            if finished:
                more_t, more_c = self.splitter.finish()
                thought, new = thought + more_t, new + more_c
            if self.draft.show_thinking and (thought or self.splitter.state == "thinking"):
                yield from self._thinking(thought)
        if self.parser is None:
            pieces: list[str | ToolCall] = [new] if new else []
        else:
            pieces = self.parser.feed(new)
            if finished:
                pieces += self.parser.finish()
        for piece in pieces:
            if isinstance(piece, ToolCall):
                yield from self._call(piece)
            elif piece:
                yield from self._text(piece)

    def _open(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.open = kind
        yield self._event("content_block_start", index=self.index, content_block=block)

    def _close(self) -> Iterator[str]:
        if self.open is None:
            return
        if self.open == "thinking":
            yield self._delta({"type": "signature_delta", "signature": signature(self.thought)})
        yield self._event("content_block_stop", index=self.index)
        self.open = None
        self.index += 1

    def _delta(self, delta: dict[str, Any]) -> str:
        return self._event("content_block_delta", index=self.index, delta=delta)

    def _thinking(self, delta: str) -> Iterator[str]:
        if self.open != "thinking":
            if self.thought or self.index:  # one thought, at the start
                return
            yield from self._open("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""})
        self.thought += delta
        if delta and not self.draft.omit_thinking:
            yield self._delta({"type": "thinking_delta", "thinking": delta})

    def _text(self, delta: str) -> Iterator[str]:
        if self.open != "text":
            yield from self._open("text", {"type": "text", "text": ""})
        yield self._delta({"type": "text_delta", "text": delta})

    def _call(self, call: ToolCall) -> Iterator[str]:
        self.calls += 1
        block = tool_use_block(call)
        yield from self._open("tool_use", {**block, "input": {}})
        yield self._delta({"type": "input_json_delta", "partial_json": call.arguments})
        yield from self._close()

    def closing(self, finals: list[RequestOutput]) -> Iterator[str]:
        yield from self._close()
        out = finals[0]
        reason, sequence = self.draft.stop(out, self.calls > 0)
        yield self._event("message_delta", delta={"stop_reason": reason,
                                                  "stop_sequence": sequence},
                          usage=usage(out))
        yield self._event("message_stop")

    def failed(self, error: APIError) -> list[str]:
        return [f"event: error\ndata: {dumps(error_body(error.status, error.message))}\n\n"]
