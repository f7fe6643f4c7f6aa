"""``POST /v1/chat/completions``: the tokenizer's chat template, then generation.

A stream opens with one ``{"role": "assistant", "content": ""}`` delta per choice, carries
content deltas, ends each choice with its ``finish_reason``, then (with include_usage) a chunk
with empty choices and the usage, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.chat_template import render_chat
from engine.outputs import RequestOutput
from server.errors import bad_request
from server.logprobs import chat_logprobs
from server.protocol import ChatCompletionRequest
from server.serving import (
    ServingContext,
    aborted_on_error,
    check_constraint,
    new_id,
    request_id_of,
    respond,
    stream_events,
    submit_or_error,
    usage_of,
)
from server.sse import event

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
# sandbox stops file access, not nested loops or huge strings), and tools/documents, which the
# model's template renders but this server does not otherwise implement.
TRUSTED_TEMPLATE_PARAMS = frozenset({"chat_template", "tools", "documents"})
_TRUST_FLAG = "--trust-request-chat-template"


def template_kwargs(req: ChatCompletionRequest, trusted: bool) -> dict[str, Any]:
    """The extra keyword arguments for ``apply_chat_template`` from a request, or a 400: see
    TEMPLATE_CALL_PARAMS and TRUSTED_TEMPLATE_PARAMS. Other ``chat_template_kwargs`` (such as
    ``enable_thinking``) are variables for the template and pass through."""
    kwargs = dict(req.chat_template_kwargs or {})
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


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request
                                 ) -> Response:
    xrid = request_id_of(raw)
    model = ctx.check_model(req.model)
    top = req.top_logprobs or 0
    ctx.check_limits(num_prompts=1, n=req.n, priority=req.priority,
                     logprobs=top if req.logprobs else None, logprobs_param="top_logprobs")
    kwargs = template_kwargs(req, ctx.trust_request_chat_template)
    try:
        text, ids = await asyncio.to_thread(
            render_chat, ctx.tokenizer, req.conversation(),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=kwargs)
        params = req.sampling_params(max_tokens=req.max_new_tokens,
                                     logprobs=top if req.logprobs else None,
                                     defaults=ctx.sampling_defaults)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages" if "template" in str(exc) else None) \
            from None
    await check_constraint(ctx, params, xrid)
    cid = new_id("chatcmpl")
    streams = submit_or_error(ctx, [(text, ids)], params, cid, req.priority, xrid)
    with aborted_on_error(streams):
        logger.info("request_id=%s %s: %d prompt tokens, n=%d, max_tokens=%s, stream=%s", xrid,
                    cid, len(ids), req.n, req.max_new_tokens, bool(req.stream))
        writer = _ChatWriter(ctx, req, cid, model, xrid)
        return await respond(raw, streams, ctx, xrid,
                             (lambda: writer.stream(raw, streams)) if req.stream else None,
                             lambda finals: writer.response(finals[0]))


class _ChatWriter:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, cid: str, model: str,
                 xrid: str) -> None:
        self.ctx, self.req, self.cid, self.model, self.xrid = ctx, req, cid, model, xrid
        self.created = int(time.time())
        self.top = req.top_logprobs or 0

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.cid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, c: Any, start: int) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.ctx.tokenizer, list(c.token_ids[start:]),
                             list((c.logprobs or [])[start:]), self.top)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, 0), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        return {**self._base("chat.completion"), "choices": choices, "usage": usage_of([out]),
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

        def deltas(_: int, out: RequestOutput) -> Iterator[str]:
            for c in out.outputs:
                i = c.index
                if done[i]:
                    continue
                delta = c.text[sent_text[i]:]
                has_lp = self.req.logprobs and len(c.token_ids) > sent_tokens[i]
                if not delta and not c.finish_reason and not has_lp:
                    continue
                lp = self._logprobs(c, sent_tokens[i])
                sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                done[i] = c.finish_reason is not None
                yield self._chunk({"index": i, "delta": {"content": delta} if delta else {},
                                   "logprobs": lp, "finish_reason": c.finish_reason,
                                   "stop_reason": c.stop_reason})

        def closing(finals: list[RequestOutput]) -> Iterator[str]:
            if self.req.include_usage and finals:
                yield event({**self._base("chat.completion.chunk"), "choices": [],
                             "usage": usage_of(finals)})

        opening = [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}) for i in range(n)]
        return stream_events(self.ctx, raw, streams, self.xrid, deltas=deltas, closing=closing,
                             opening=opening)
