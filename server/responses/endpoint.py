"""The Responses API's routes: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

``POST`` checks the input's images first (server/media: a refused image, or any image while
the model takes none, is a 400 naming ``input.<i>.content.<j>...``), then serves the request
through the chat machinery (server.chat.chat_prompt: template,
tools, constraints), continuing the stored conversation of ``previous_response_id`` (404 when
no stored response has that id: never stored, evicted, deleted, or the server restarted). With
``store`` (the default) the finished response is kept (server.responses.store) under its id;
its conversation is the predecessor's, then this request's input, then its output, so a chain
of ``previous_response_id`` renders the same growing prompt and the prefix cache serves what
the turns before computed. ``DELETE`` of a response still being generated succeeds: its
client still gets all of it, and it is not stored when it finishes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import ValidationError

from server.chat import chat_prompt
from server.errors import APIError, bad_request, format_validation_errors
from server.media.check import checked_images
from server.media.collect import responses_image_refs
from server.protocol import ChatCompletionRequest
from server.responses.items import chat_messages, item_id
from server.responses.request import ResponsesRequest
from server.responses.store import Pending, ResponseStore, StoredResponse
from server.responses.writer import ResponseDraft, ResponseEvents
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


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no stored response has the id {response_id!r} (responses are kept "
                         "in memory while the store's bounds allow, and only with store: true)",
                    param=param, code="response_not_found")


async def create_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest,
                          raw: Request) -> Response:
    xrid = request_id_of(raw)
    model = ctx.check_model(req.model)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = prev.context
    images = await checked_images(responses_image_refs, req.input, ctx.media, model=model,
                                  takes_images=ctx.takes_images)
    _check_results(history, req.items)
    try:
        chat = ChatCompletionRequest.model_validate(req.chat_body(chat_messages(history)))
    except ValidationError as exc:
        message, param = format_validation_errors(list(exc.errors()))
        raise bad_request(message, _as_input(param)) from None
    rid = item_id("resp")
    try:
        prompt = await chat_prompt(ctx, chat, xrid, client_of(raw), images)
        streams = submit_or_error(ctx, [(prompt.text, prompt.ids)], prompt.params, rid,
                                  chat.priority, xrid, model=model, images=prompt.images)
    except APIError as exc:
        exc.param = _as_input(exc.param)
        raise
    with aborted_on_error(streams):
        logger.info("request_id=%s %s: %d prompt tokens, max_output_tokens=%s, stream=%s, "
                    "previous=%s", xrid, rid, len(prompt.ids), req.max_output_tokens,
                    bool(req.stream), req.previous_response_id)
        keep = req.store is not False and store.enabled
        draft = ResponseDraft(rid, model, req.echo(), keep, prompt.tools, ctx.tool_format,
                              ctx.reasoning, prompt.thinking, ctx.tokenizer)
        # Held by `finish` (so by the stream) until the response is stored: a DELETE meanwhile
        # succeeds and the response is then not stored.
        pending = store.begin(rid) if keep else None

        def finish(final: dict[str, Any]) -> dict[str, Any]:
            if pending is not None:
                store.put(StoredResponse(final, req.items, history + req.items + final["output"]),
                          pending)
            return final

        if req.stream:
            events = ResponseEvents(draft, finish)
            return await respond(raw, streams, ctx, xrid, lambda: _released(stream_events(
                ctx, raw, streams, xrid, deltas=events.deltas, closing=events.closing,
                opening=events.opening(), failed=events.failed, done=False), store, pending),
                None)
        try:
            return await respond(raw, streams, ctx, xrid, None,
                                 lambda finals: finish(draft.response(finals[0])))
        finally:
            store.release(pending)


async def _released(events: AsyncIterator[str], store: ResponseStore, pending: Pending | None
                    ) -> AsyncIterator[str]:
    """``events``, then the response's pending entry is released however the stream ended
    (stored, failed, the client gone)."""
    try:
        async with contextlib.aclosing(events) as it:
            async for e in it:
                yield e
    finally:
        store.release(pending)


def _as_input(param: str | None) -> str | None:
    """The chat machinery's ``messages...`` / ``prompt`` parameter is this request's ``input``
    (the messages also hold the instructions and the stored conversation, so no index carries
    over)."""
    if param is not None and (param.startswith("messages") or param == "prompt"):
        return "input"
    return param


def _check_results(history: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """400 for a function_call_output that answers no earlier function_call (of this input or
    of the stored conversation it continues)."""
    calls = {item["call_id"] for item in history if item["type"] == "function_call"}
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise bad_request(f"function_call_output {item['call_id']!r} answers no earlier "
                              "function_call (in this input or the conversation of "
                              "previous_response_id)", param=f"input.{i}.call_id")


def list_input_items(stored: StoredResponse, order: str, limit: int, after: str | None
                     ) -> dict[str, Any]:
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise bad_request(f"no input item of this response has the id {after!r}",
                              param="after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def add_routes(app: FastAPI, ctx: ServingContext, store: ResponseStore) -> None:
    def stored(response_id: str) -> StoredResponse:
        found = store.get(response_id)
        if found is None:
            raise not_found(response_id)
        return found

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, store, req, raw)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return stored(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, order: Literal["asc", "desc"] = "desc",
                          limit: int = Query(20, ge=1, le=100),
                          after: str | None = None) -> dict[str, Any]:
        return list_input_items(stored(response_id), order, limit, after)
