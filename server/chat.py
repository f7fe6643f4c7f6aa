"""``POST /v1/chat/completions``: the tokenizer's chat template, then generation.

A stream opens with one ``{"role": "assistant", "content": ""}`` delta per choice, carries
content deltas, ends each choice with its ``finish_reason``, then (with include_usage) a chunk
with empty choices and the usage, then ``[DONE]``.

With tools (server/tools) and a tool_choice other than ``none``, the output is constrained to
the tool-call format and parsed: ``message.tool_calls`` (``call_<hex>`` ids, 9 letters and
digits for mistral; arguments as JSON text), ``content`` the text before the first call (null
if none), ``finish_reason`` ``"tool_calls"`` when the output has a call and ended by itself
(``"length"`` stays). A format whose call marker is a special token (mistral's
``[TOOL_CALLS]``) decodes the output with special tokens kept, as vLLM does. Calls are read
incrementally (server/tools/parser.py): a stream opens each call with ``{"index", "id",
"type", "function": {"name", "arguments": ""}}`` once its name is written, then sends
``{"index", "function": {"arguments": piece}}`` as its arguments are written (a format read
whole: one piece when the call ends); the pieces concatenate to the call's arguments. An
output cut by ``max_tokens`` inside a call gives that call as far as it was written (arguments
possibly incomplete JSON, ``finish_reason: "length"``), never its markup as content; cut before
its name, the call is left out (no ``tool_calls``). The non-streamed message holds what the
stream's deltas add up to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.chat_template import render_chat
from engine.params.prompt_image import PromptImage
from engine.params.sampling import SamplingParams
from engine.request_output import RequestOutput
from server.errors import bad_request
from server.logprobs import chat_logprobs
from server.media.check import checked_images
from server.media.collect import ImageInput, chat_image_refs
from server.prompt_bound import check_chars, released_after
from server.protocol import ChatCompletionRequest
from server.reasoning.fields import reasoning_tokens
from server.reasoning.gate import thinking_gate
from server.reasoning.splitter import ReasoningSplitter
from server.serving import (
    ServingContext,
    aborted_on_error,
    check_constraint,
    client_of,
    new_id,
    request_id_of,
    respond,
    stream_events,
    submit_or_error,
    usage_of,
)
from server.sse import event
from server.tools.constraint import tool_call_spec
from server.tools.parser import (
    ArgumentsDelta,
    CallStart,
    StreamingToolParser,
    ToolCall,
    parse_tool_calls,
    reads_channels,
)
from server.tools.prompt import tool_conversation
from server.tools.request import ToolSet

logger = logging.getLogger("kvserve.server")


# apply_chat_template's own parameters: they change what it returns (token ids, tensors, a
# dict), how it tokenises, or repeat a request field. Never taken from a request (vLLM refuses
# ``tokenize`` and ``chat_template`` in chat_template_kwargs likewise).
TEMPLATE_CALL_PARAMS = frozenset({
    "conversation", "tokenize", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "padding", "truncation", "max_length", "add_generation_prompt",
    "continue_final_message"})
# What a request may hand the template only when the operator trusts requests' templates
# (--trust-request-chat-template): a template of its own (arbitrary Jinja on this server: the
# sandbox stops file access, not nested loops or huge strings), and tools/documents handed to
# the template directly (the request's own ``tools`` field is validated, constrained and
# parsed: server/tools).
TRUSTED_TEMPLATE_PARAMS = frozenset({"chat_template", "tools", "documents"})
_TRUST_FLAG = "--trust-request-chat-template"


def template_kwargs(req: ChatCompletionRequest, trusted: bool,
                    defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The extra keyword arguments for ``apply_chat_template`` from a request, or a 400: see
    TEMPLATE_CALL_PARAMS and TRUSTED_TEMPLATE_PARAMS. Other ``chat_template_kwargs`` (such as
    ``enable_thinking``) are variables for the template and pass through, over ``defaults``
    (the operator's --default-chat-template-kwargs)."""
    kwargs = {**(defaults or {}), **(req.chat_template_kwargs or {})}
    for key in sorted(kwargs):
        if key in TEMPLATE_CALL_PARAMS:
            hint = (f"; set the request's own {key} field instead" if key in
                    ("add_generation_prompt", "continue_final_message") else "")
            raise bad_request(f"chat_template_kwargs may not set {key!r}: it is a parameter "
                              f"of apply_chat_template that the server sets itself{hint}",
                              param=f"chat_template_kwargs.{key}")
        if key in TRUSTED_TEMPLATE_PARAMS and not trusted:
            raise bad_request(f"chat_template_kwargs.{key} is refused: requests may not pass "
                              f"{key!r} to the chat template unless the server was started "
                              f"with {_TRUST_FLAG}", param=f"chat_template_kwargs.{key}")
    for key in ("chat_template", "documents"):
        value = getattr(req, key)
        if value is None:
            continue
        if not trusted:
            what = ("a chat template of its own" if key == "chat_template" else
                    "documents for the chat template")
            raise bad_request(f"{key} is refused: a request may bring {what} only when the "
                              f"server was started with {_TRUST_FLAG}", param=key)
        kwargs[key] = value
    return kwargs


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request made ready for the engine: the rendered prompt, its token ids, the
    sampling parameters (with the tool-call constraint, compiled already) and the tools whose
    calls are to be parsed out of the output (None when none are expected)."""

    text: str
    ids: list[int]
    params: SamplingParams
    tools: ToolSet | None
    thinking: bool = False  # the prompt opened a thought: the output starts inside it
    images: tuple[PromptImage, ...] = ()  # placed on the prompt's image tokens


async def chat_prompt(ctx: ServingContext, req: ChatCompletionRequest, xrid: str,
                      client: str = "", images: list[ImageInput] | None = None) -> ChatPrompt:
    """Render, tokenise and constrain a chat request (400 on anything wrong with it): what
    ``/v1/chat/completions`` and ``/v1/responses`` share up to submitting. Its images are
    checked first (server/media: a refused image, or any image while the model takes none,
    is the API's error naming the field); a route that checked them in its own API's shape
    (Responses, Messages) passes ``images``."""
    if images is None:
        images = await checked_images(chat_image_refs, req.messages, ctx.media,
                                      model=ctx.check_model(req.model),
                                      takes_images=ctx.takes_images)
    top = req.top_logprobs or 0
    ctx.check_limits(num_prompts=1, n=req.n, priority=req.priority,
                     logprobs=top if req.logprobs else None, logprobs_param="top_logprobs")
    kwargs = template_kwargs(req, ctx.trust_request_chat_template, ctx.default_template_kwargs)
    tools = req.tool_set
    if tools is not None and tools.choice == "auto" and not ctx.enable_auto_tool_choice:
        raise bad_request("tool_choice 'auto' needs the server started with "
                          "--enable-auto-tool-choice", param="tool_choice")
    messages, tool_kwargs = tool_conversation(
        req.conversation(), tools.openai_tools() if tools else None, ctx.tool_format,
        ctx.tools_native)
    kwargs.update(tool_kwargs)
    try:
        text, ids = await asyncio.to_thread(
            render_chat, ctx.tokenizer, messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=kwargs,
            check_text=lambda t: check_chars(ctx.prompt_bound, len(t), "messages"),
            expand=ctx.image_prompts.expand if images else None)
        await released_after(len(text))
        placed = (await asyncio.to_thread(ctx.image_prompts.place, images, ids)
                  if images else ())
        params = req.sampling_params(max_tokens=req.max_new_tokens,
                                     logprobs=top if req.logprobs else None,
                                     defaults=ctx.sampling_defaults)
        spec = tool_call_spec(ctx.tool_format, tools) if tools is not None else None
    except ValueError as exc:
        raise bad_request(str(exc), param="messages" if "template" in str(exc) else None) \
            from None
    if spec is not None:
        params = params.clone(structured=spec)
    if ctx.tool_format.special_marker and (spec is not None or
                                           reads_channels(ctx.tool_format)):
        params = params.clone(skip_special_tokens=False)  # the markers are special tokens
    budget = req.thinking_token_budget
    gate = thinking_gate(ctx.reasoning, ctx.tokenizer, text, params,
                         ctx.reasoning_budget if budget is None else budget)
    if gate is not None:
        params = params.clone(thinking=gate)
    await check_constraint(ctx, params, xrid, client)
    expected = tools if tools is not None and tools.calls_expected else None
    thinking = ctx.reasoning is not None and ctx.reasoning.starts_thinking(text)
    return ChatPrompt(text, ids, params, expected, thinking, placed)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request
                                 ) -> Response:
    xrid = request_id_of(raw)
    model = ctx.check_model(req.model)
    prompt = await chat_prompt(ctx, req, xrid, client_of(raw))
    cid = new_id("chatcmpl")
    streams = submit_or_error(ctx, [(prompt.text, prompt.ids)], prompt.params, cid,
                              req.priority, xrid, model=model, images=prompt.images)
    with aborted_on_error(streams):
        logger.info("request_id=%s %s: %d prompt tokens, n=%d, max_tokens=%s, stream=%s", xrid,
                    cid, len(prompt.ids), req.n, req.max_new_tokens, bool(req.stream))
        writer = _ChatWriter(ctx, req, cid, model, xrid, prompt.tools, prompt.thinking)
        return await respond(raw, streams, ctx, xrid,
                             (lambda: writer.stream(raw, streams)) if req.stream else None,
                             lambda finals: writer.response(finals[0]))


class _ChatWriter:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, cid: str, model: str,
                 xrid: str, tools: ToolSet | None, thinking: bool = False) -> None:
        self.ctx, self.req, self.cid, self.model, self.xrid = ctx, req, cid, model, xrid
        self.created = int(time.time())
        self.top = req.top_logprobs or 0
        self.tools = tools  # parsed for calls; None: none expected
        self.thinking = thinking  # the output starts inside a thought (ChatPrompt.thinking)
        self.show_reasoning = req.include_reasoning is not False
        # What the output is parsed for: the tools' calls, or (a format whose messages mark
        # their channels: harmony) the channels even without tools; None: plain text.
        self.names = tools.names if tools is not None else \
            (() if reads_channels(ctx.tool_format) else None)

    def _splitter(self) -> ReasoningSplitter | None:
        fmt = self.ctx.reasoning
        return ReasoningSplitter(fmt, self.thinking) if fmt is not None else None

    def _reasoning_tokens(self, c: Any) -> int:
        fmt, splitter = self.ctx.reasoning, self._splitter()
        if fmt is None or splitter is None:
            return 0
        reasoning, _ = splitter.split(c.text)
        return reasoning_tokens(self.ctx.tokenizer, fmt, c.token_ids, reasoning,
                                splitter.thought_ended)

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        u = usage_of([out])
        if self.ctx.reasoning is not None:
            u["completion_tokens_details"] = {
                "reasoning_tokens": sum(self._reasoning_tokens(c) for c in out.outputs)}
        return u

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.cid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: Any, start: int) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.ctx.tokenizer, list(c.token_ids[start:]),
                             list((c.logprobs or [])[start:]), self.top)

    def _message(self, c: Any) -> tuple[dict[str, Any], str | None]:
        """A choice's message and finish_reason: its thought parsed out (with a reasoning
        parser), then its tool calls (when expected)."""
        text, extra = c.text, {}
        splitter = self._splitter()
        if splitter is not None:
            reasoning, text = splitter.split(c.text)
            if reasoning is not None and self.show_reasoning:
                extra = {"reasoning_content": reasoning, "reasoning": reasoning}
        if self.names is None:
            return {"role": "assistant", "content": text, **extra}, c.finish_reason
        parsed = parse_tool_calls(text, self.ctx.tool_format, self.names, incremental=True,
                                  cut=c.finish_reason == "length")
        if parsed.reasoning is not None and self.show_reasoning:
            extra = {"reasoning_content": parsed.reasoning, "reasoning": parsed.reasoning}
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content, **extra}
        if parsed.calls:
            message["tool_calls"] = [self._call_json(call) for call in parsed.calls]
        return message, _finish(c.finish_reason, bool(parsed.calls))

    def _call_json(self, call: ToolCall) -> dict[str, Any]:
        return {"id": self.ctx.tool_format.call_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _call_parts(self, events: list, calls: list[int], i: int) -> Iterator[dict[str, Any]]:
        """The ``delta.tool_calls`` entries of choice ``i``'s call events: a call's head
        (``calls[i]`` counts the calls opened), then its arguments pieces."""
        for e in events:
            if isinstance(e, (CallStart, ToolCall)):
                body = self._call_json(ToolCall(e.name, ""))
                calls[i] += 1
                yield {"index": calls[i] - 1, **body}
            if isinstance(e, (ArgumentsDelta, ToolCall)):
                text = e.text if isinstance(e, ArgumentsDelta) else e.arguments
                if text:
                    yield {"index": calls[i] - 1, "function": {"arguments": text}}

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            message, finish = self._message(c)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c, 0), "finish_reason": finish,
                            "stop_reason": c.stop_reason})
        return {**self._base("chat.completion"), "choices": choices, "usage": self._usage(out),
                "system_fingerprint": None}

    def _chunk(self, choice: dict[str, Any]) -> str:
        body = {**self._base("chat.completion.chunk"), "choices": [choice]}
        if self.req.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return event(body)

    def stream(self, raw: Request, streams: list) -> AsyncIterator[str]:
        n = self.req.n
        sent_text = [0] * n
        sent_tokens = [0] * n
        done = [False] * n
        names = self.names
        parsers = [StreamingToolParser(self.ctx.tool_format, names, incremental=True)
                   for _ in range(n)] if names is not None else []
        splitters = [self._splitter() for _ in range(n)]
        calls = [0] * n

        def split(c: Any) -> Iterator[str]:
            """The choice's new text past its thought (with a reasoning parser), after yielding
            the thought's part as a reasoning delta."""
            i = c.index
            piece = c.text[sent_text[i]:]
            sent_text[i] = len(c.text)
            splitter = splitters[i]
            if splitter is None:
                return piece
            reasoning, content = splitter.feed(piece)
            if c.finish_reason is not None:
                more_r, more_c = splitter.finish()
                reasoning, content = reasoning + more_r, content + more_c
            if reasoning and self.show_reasoning:
                yield self._chunk({"index": i, "delta": {"reasoning_content": reasoning,
                                                         "reasoning": reasoning},
                                   "logprobs": None, "finish_reason": None})
            return content

        def tool_deltas(c: Any, piece: str) -> Iterator[str]:
            i = c.index
            events = parsers[i].feed(piece)
            if c.finish_reason is not None:
                events += parsers[i].finish(cut=c.finish_reason == "length")
            thought = parsers[i].take_reasoning()
            if thought and self.show_reasoning:
                yield self._chunk({"index": i, "delta": {"reasoning_content": thought,
                                                         "reasoning": thought},
                                   "logprobs": None, "finish_reason": None})
            content = "".join(e for e in events if isinstance(e, str))
            has_lp = self.req.logprobs and len(c.token_ids) > sent_tokens[i]
            if content or has_lp:
                yield self._chunk({"index": i, "delta": {"content": content} if content else {},
                                   "logprobs": self._logprobs(c, sent_tokens[i]),
                                   "finish_reason": None})
            sent_tokens[i] = len(c.token_ids)
            for part in self._call_parts(events, calls, i):
                yield self._chunk({"index": i, "delta": {"tool_calls": [part]},
                                   "logprobs": None, "finish_reason": None})
            if c.finish_reason is not None:
                done[i] = True
                yield self._chunk({"index": i, "delta": {}, "logprobs": None,
                                   "finish_reason": _finish(c.finish_reason, calls[i] > 0),
                                   "stop_reason": c.stop_reason})

        def deltas(_: int, out: RequestOutput) -> Iterator[str]:
            for c in out.outputs:
                i = c.index
                if done[i]:
                    continue
                delta = yield from split(c)
                if names is not None:
                    yield from tool_deltas(c, delta)
                    continue
                has_lp = self.req.logprobs and len(c.token_ids) > sent_tokens[i]
                if not delta and not c.finish_reason and not has_lp:
                    continue
                lp = self._logprobs(c, sent_tokens[i])
                sent_tokens[i] = len(c.token_ids)
                done[i] = c.finish_reason is not None
                yield self._chunk({"index": i, "delta": {"content": delta} if delta else {},
                                   "logprobs": lp, "finish_reason": c.finish_reason,
                                   "stop_reason": c.stop_reason})

        def closing(outs: list[RequestOutput]) -> Iterator[str]:
            if self.req.include_usage and outs:
                yield event({**self._base("chat.completion.chunk"), "choices": [],
                             "usage": self._usage(outs[0])})

        def cut_short() -> Iterator[str]:  # the drain's budget ran out: vLLM's "abort"
            for i in range(n):
                if not done[i]:
                    done[i] = True
                    yield self._chunk({"index": i, "delta": {}, "logprobs": None,
                                       "finish_reason": "abort", "stop_reason": None})

        opening = [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}) for i in range(n)]
        return stream_events(self.ctx, raw, streams, self.xrid, deltas=deltas, closing=closing,
                             opening=opening, cut_short=cut_short)



def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for an output with calls that ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason
