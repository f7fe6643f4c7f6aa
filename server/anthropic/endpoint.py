"""The Messages API's routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Both check the request's images first (server/media: a refused image, or any image while the
model takes none, is a 400 naming ``messages.<i>.content.<j>.source...``). Both are served by
the chat machinery: the Anthropic body becomes a ``/v1/chat/completions``
request (server.anthropic.request) and goes through ``server.chat.chat_prompt`` (template,
tools, tool-call constraint, whether the output starts inside a thought); the engine's output is
written as Anthropic's message or event stream (server.anthropic.writer). ``count_tokens``
renders the same prompt and counts its tokens (``{"input_tokens": N}``: what a Messages request
with the same body reports as ``input_tokens + cache_read_input_tokens``). The
``anthropic-version`` and ``anthropic-beta`` headers are accepted and ignored.

``max_tokens`` is a cap, as on Anthropic's API (clients such as Claude Code send 32000 or more
whatever the model): where the prompt leaves less room in ``--max-model-len``, generation stops
at the window's end with ``stop_reason: "model_context_window_exceeded"``; a prompt that fills
the window is a 400.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from server.anthropic.errors import document_errors
from server.anthropic.request import CountTokensRequest, MessagesRequest
from server.anthropic.writer import MessageDraft, MessageEvents, new_message_id
from server.chat import chat_prompt
from server.errors import APIError, bad_request, format_validation_errors
from server.media.check import checked_images
from server.media.collect import ImageInput, anthropic_image_refs
from server.protocol import ChatCompletionRequest
from server.serving import (
    ServingContext,
    aborted_on_error,
    client_of,
    request_id_of,
    respond,
    stream_events,
    submit_or_error,
)

logger = logging.getLogger("kvserve.server")

# The chat request's names in a message, as the Messages API names them (the chat messages'
# indices are not the request's: a user message may become several).
_NAMES = ((re.compile(r"\btools\.(\d+)\.function\.parameters"), r"tools.\1.input_schema"),
          (re.compile(r"\btools\.(\d+)\.function\.(\w+)"), r"tools.\1.\2"),
          (re.compile(r"\btool_choice\.function\.name"), "tool_choice.name"),
          (re.compile(r"\bmessages\.\d+(\.\w+)*"), "messages"),
          (re.compile(r"^stop\b"), "stop_sequences"))


def _renamed(text: str | None) -> str | None:
    if text is None:
        return None
    for pattern, repl in _NAMES:
        text = pattern.sub(repl, text)
    return text


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        message, param = format_validation_errors(list(exc.errors()))
        raise bad_request(_renamed(message) or message, _renamed(param)) from None


async def _prompt(ctx: ServingContext, chat: ChatCompletionRequest, xrid: str, raw: Request,
                  images: list[ImageInput]) -> Any:
    try:
        return await chat_prompt(ctx, chat, xrid, client_of(raw), images)
    except APIError as exc:
        exc.message, exc.param = _renamed(exc.message) or exc.message, _renamed(exc.param)
        raise


async def _images(ctx: ServingContext, req: CountTokensRequest, model: str
                  ) -> list[ImageInput]:
    """The request's images, checked in the Messages API's names (server/media)."""
    return await checked_images(anthropic_image_refs, req.messages, ctx.media, model=model,
                                takes_images=ctx.takes_images)


async def create_message(ctx: ServingContext, req: MessagesRequest, raw: Request) -> Response:
    xrid = request_id_of(raw)
    model = ctx.check_model(req.model)
    images = await _images(ctx, req, model)
    chat = _chat_request(req.chat_body())
    prompt = await _prompt(ctx, chat, xrid, raw, images)
    mid = new_message_id()
    params, clamped = prompt.params, False
    room = ctx.engine.max_model_len - len(prompt.ids)
    if 0 < room < req.max_tokens:  # max_tokens is a cap: the context window ends it first
        params, clamped = params.clone(max_tokens=room), True
    streams = submit_or_error(ctx, [(prompt.text, prompt.ids)], params, mid, chat.priority,
                              xrid, model=model, images=prompt.images)
    with aborted_on_error(streams):
        logger.info("request_id=%s %s: %d prompt tokens, max_tokens=%d, stream=%s", xrid, mid,
                    len(prompt.ids), req.max_tokens, req.stream)
        draft = MessageDraft(mid, model, list(req.stop_sequences or []), prompt.tools,
                             ctx.tool_format, ctx.reasoning, prompt.thinking,
                             req.shows_thinking, req.omits_thinking, clamped)
        if req.stream:
            events = MessageEvents(draft)
            return await respond(raw, streams, ctx, xrid, lambda: stream_events(
                ctx, raw, streams, xrid, deltas=events.deltas, closing=events.closing,
                failed=events.failed, done=False), None)
        return await respond(raw, streams, ctx, xrid, None,
                             lambda finals: draft.message(finals[0]))


async def count_tokens(ctx: ServingContext, req: CountTokensRequest, raw: Request
                       ) -> dict[str, int]:
    xrid = request_id_of(raw)
    images = await _images(ctx, req, ctx.check_model(req.model))
    prompt = await _prompt(ctx, _chat_request(req.chat_body(counting=True)), xrid, raw,
                           images)
    return {"input_tokens": len(prompt.ids)}


def add_routes(app: FastAPI, ctx: ServingContext) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:  # these routes' errors documented in Anthropic's shape
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await create_message(ctx, req, raw)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest, raw: Request) -> dict[str, int]:
        return await count_tokens(ctx, req, raw)
