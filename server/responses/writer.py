"""The response object of the Responses API, whole or as its stream of typed events.

A response is ``completed``, ``incomplete`` (``incomplete_details.reason "max_output_tokens"``)
or ``failed`` (streams only; a non-streamed failure is an HTTP error).
``output``: a ``reasoning`` item first when a reasoning parser split a thought off, the model's
text as one assistant ``message`` (when it wrote text, or made no call), a ``function_call``
item per call (parsed as on ``/v1/chat/completions``). ``usage``: ``input_tokens`` (with
``input_tokens_details.cached_tokens``), ``output_tokens`` (with
``output_tokens_details.reasoning_tokens``), ``total_tokens``.

A stream is ``event: <type>`` / ``data: {json}`` pairs, each with a growing
``sequence_number``, and no ``[DONE]``: ``response.created``, ``response.in_progress``, then per
item ``response.output_item.added``, its deltas (``output_text``, ``reasoning_text``,
``function_call_arguments``; a message's inside its ``content_part``) and ``.done`` events,
``response.output_item.done``; then ``response.completed`` (or ``.incomplete``, ``.failed``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.request_output import RequestOutput
from server.errors import APIError
from server.reasoning.fields import reasoning_tokens
from server.reasoning.formats import ReasoningFormat
from server.reasoning.splitter import ReasoningSplitter
from server.responses.items import function_call_item, item_id, output_items
from server.serving import usage_of
from server.sse import dumps
from server.tools.formats import ToolCallFormat
from server.tools.parser import StreamingToolParser, ToolCall, parse_tool_calls, reads_channels
from server.tools.request import ToolSet


def responses_usage(out: RequestOutput, reasoning: int = 0) -> dict[str, Any]:
    u = usage_of([out])
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": u["total_tokens"]}


def reasoning_item(text: str, item: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item or item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


@dataclass
class ResponseDraft:
    """What a response object repeats of its request, and how to finish it."""

    id: str
    model: str
    echo: dict[str, Any]  # ResponsesRequest.echo()
    store: bool
    tools: ToolSet | None  # calls parsed out of the output; None: none expected
    fmt: ToolCallFormat
    reasoning: ReasoningFormat | None = None  # the thought parsed out first; None: none
    thinking: bool = False  # the output starts inside the thought (ChatPrompt.thinking)
    tokenizer: Any = None  # counts the thought's tokens
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def names(self) -> Any:
        """What the output is parsed for: the tools' names, () for a format that marks its
        channels (harmony) without tools, None: plain text."""
        if self.tools is not None:
            return self.tools.names
        return () if reads_channels(self.fmt) else None

    def splitter(self) -> ReasoningSplitter | None:
        return ReasoningSplitter(self.reasoning, self.thinking) if self.reasoning else None

    def body(self, status: str, output: list[dict[str, Any]], *,
             usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
             incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                "model": self.model, "output": output, "usage": usage, "store": self.store,
                **self.echo}

    def finished(self, out: RequestOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        c = out.outputs[0]
        cut = c.finish_reason == "length"
        spent = 0
        splitter = self.splitter()
        if splitter is not None and self.reasoning is not None:
            thought, _ = splitter.split(c.text)
            spent = reasoning_tokens(self.tokenizer, self.reasoning, c.token_ids, thought,
                                     splitter.thought_ended)
        return self.body("incomplete" if cut else "completed", output,
                         usage=responses_usage(out, spent),
                         incomplete={"reason": "max_output_tokens"} if cut else None)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        """The whole response of a finished output."""
        text, first = out.outputs[0].text, []
        splitter = self.splitter()
        if splitter is not None:
            thought, text = splitter.split(text)
            first = [reasoning_item(thought)] if thought is not None else []
        names = self.names
        if names is None:
            return self.finished(out, first + output_items(text, (), self.fmt.call_id))
        parsed = parse_tool_calls(text, self.fmt, names)
        if parsed.reasoning is not None:  # a thought the format marks (harmony's analysis)
            first = [reasoning_item(parsed.reasoning)]
        return self.finished(out, first + output_items(parsed.content, parsed.calls,
                                                       self.fmt.call_id))


class ResponseEvents:
    """The event stream of one response; ``on_final`` gets the final response object (to
    store it) before ``response.completed`` is sent."""

    def __init__(self, draft: ResponseDraft,
                 on_final: Callable[[dict[str, Any]], None]) -> None:
        self.draft, self.on_final = draft, on_final
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None  # the open message item
        self.sent = 0
        names = draft.names
        self.parser = StreamingToolParser(draft.fmt, names) if names is not None else None
        self.splitter = draft.splitter()
        self.thought: dict[str, Any] | None = None  # the open reasoning item

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(body)}\n\n"

    def opening(self) -> list[str]:
        start = self.draft.body("in_progress", [])
        return [self._event("response.created", response=start),
                self._event("response.in_progress", response=start)]

    def deltas(self, _: int, out: RequestOutput) -> Iterator[str]:
        c = out.outputs[0]
        new, self.sent = c.text[self.sent:], len(c.text)
        if self.splitter is not None:
            thought, new = self.splitter.feed(new)
            if c.finish_reason is not None:
                more_t, more_c = self.splitter.finish()
                thought, new = thought + more_t, new + more_c
            if thought or (self.thought is None and self.splitter.state == "thinking"):
                yield from self._reasoning(thought)
            if new or self.splitter.thought_ended:
                yield from self._close_reasoning()
        if self.parser is None:
            pieces: list[str | ToolCall] = [new] if new else []
        else:
            pieces = self.parser.feed(new)
            if c.finish_reason is not None:
                pieces += self.parser.finish()
            thought = self.parser.take_reasoning()  # harmony's analysis channel
            if thought:
                yield from self._reasoning(thought)
            if self.thought is not None and any(pieces):
                yield from self._close_reasoning()
        for piece in pieces:
            if isinstance(piece, ToolCall):
                yield from self._call(piece)
            elif piece:
                yield from self._text(piece)

    def _reasoning(self, delta: str) -> Iterator[str]:
        if self.thought is None:
            self.thought = {"id": item_id("rs"), "index": len(self.items), "text": ""}
            yield self._event("response.output_item.added", output_index=self.thought["index"],
                              item={"type": "reasoning", "id": self.thought["id"],
                                    "summary": [], "content": [], "status": "in_progress"})
        if delta:
            self.thought["text"] += delta
            yield self._event("response.reasoning_text.delta", item_id=self.thought["id"],
                              output_index=self.thought["index"], content_index=0,
                              delta=delta)

    def _close_reasoning(self) -> Iterator[str]:
        if self.thought is None or self.thought.get("closed"):
            return
        self.thought["closed"] = True
        where = {"item_id": self.thought["id"], "output_index": self.thought["index"]}
        yield self._event("response.reasoning_text.done", **where, content_index=0,
                          text=self.thought["text"])
        item = reasoning_item(self.thought["text"], self.thought["id"])
        yield self._event("response.output_item.done", output_index=self.thought["index"],
                          item=item)
        self.items.append(item)

    def _open_text(self) -> Iterator[str]:
        self.text = {"id": item_id("msg"), "index": len(self.items), "text": ""}
        yield self._event("response.output_item.added", output_index=self.text["index"],
                          item={"type": "message", "id": self.text["id"],
                                "status": "in_progress", "role": "assistant", "content": []})
        yield self._event("response.content_part.added", item_id=self.text["id"],
                          output_index=self.text["index"], content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})

    def _text(self, delta: str) -> Iterator[str]:
        if self.text is None:
            yield from self._open_text()
        assert self.text is not None
        self.text["text"] += delta
        yield self._event("response.output_text.delta", item_id=self.text["id"],
                          output_index=self.text["index"], content_index=0, delta=delta,
                          logprobs=[])

    def _close_text(self) -> Iterator[str]:
        if self.text is None:
            return
        where = {"item_id": self.text["id"], "output_index": self.text["index"]}
        part = {"type": "output_text", "text": self.text["text"], "annotations": []}
        yield self._event("response.output_text.done", **where, content_index=0,
                          text=self.text["text"], logprobs=[])
        yield self._event("response.content_part.done", **where, content_index=0, part=part)
        item = {"type": "message", "id": self.text["id"], "status": "completed",
                "role": "assistant", "content": [part]}
        yield self._event("response.output_item.done", output_index=self.text["index"],
                          item=item)
        self.items.append(item)
        self.text = None

    def _call(self, call: ToolCall) -> Iterator[str]:
        yield from self._close_text()
        item = function_call_item(call, self.draft.fmt.call_id())
        index = len(self.items)
        yield self._event("response.output_item.added", output_index=index,
                          item={**item, "arguments": "", "status": "in_progress"})
        where = {"item_id": item["id"], "output_index": index}
        yield self._event("response.function_call_arguments.delta", **where,
                          delta=call.arguments)
        yield self._event("response.function_call_arguments.done", **where, name=call.name,
                          arguments=call.arguments)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)

    def closing(self, finals: list[RequestOutput]) -> Iterator[str]:
        yield from self._close_reasoning()
        if not any(i["type"] != "reasoning" for i in self.items) and self.text is None:
            yield from self._open_text()  # no text and no call: still one (empty) message
        yield from self._close_text()
        final = self.draft.finished(finals[0], self.items)
        self.on_final(final)
        kind = "response.incomplete" if final["status"] == "incomplete" else \
            "response.completed"
        yield self._event(kind, response=final)

    def failed(self, error: APIError) -> list[str]:
        body = self.draft.body("failed", self.items, error={
            "code": error.code or "server_error", "message": error.message})
        return [self._event("response.failed", response=body)]
