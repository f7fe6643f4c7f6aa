"""What the completions and chat endpoints share: the serving context, model checks,
submitting prompts to the engine, merging streams, watching for a client that went away, and
turning engine exceptions into HTTP errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import APIError, bad_request, internal_error
from server.metrics import ServerMetrics
from server.sse import sse_response

logger = logging.getLogger("kvserve.server")


@dataclass
class ServingContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_names: list[str]
    model_root: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The served name to report; 404 for a model this server does not serve."""
        if model is None or model in self.served_model_names:
            return self.model_name
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.served_model_names)}.",
                       type="invalid_request_error", param="model", code="model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_id_of(raw: Request) -> str:
    return getattr(raw.state, "request_id", None) or uuid.uuid4().hex


def engine_error(exc: BaseException, ctx: ServingContext, request_id: str) -> APIError:
    """The HTTP error for an exception raised by submitting to or reading from the engine."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDrainingError):
        ctx.metrics.reject("shutting_down")
        return APIError(503, str(exc), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, QueueFullError):
        ctx.metrics.reject("queue_full")
        return APIError(503, str(exc), code="queue_full",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.error("request_id=%s engine error: %r", request_id, exc, exc_info=exc)
    return internal_error(request_id)


def submit_all(ctx: ServingContext, prompts: list[tuple[str | None, list[int]]],
               params: SamplingParams, base_id: str, priority: int = 0) -> list[RequestStream]:
    """Validate every prompt, then submit them all; on any failure nothing stays submitted."""
    engine = ctx.engine
    for i, (_, ids) in enumerate(prompts):
        try:
            engine.check_request(ids, params)
        except ValueError as exc:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise bad_request(f"{where}{exc}", param="prompt") from None
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            streams.append(engine.submit(ids, params, f"{base_id}-{i}", prompt=text,
                                         priority=priority))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: yields (prompt index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


@contextlib.asynccontextmanager
async def abort_on_disconnect(raw: Request, streams: list[RequestStream]) -> AsyncIterator[None]:
    """While inside, a client disconnect aborts ``streams`` (their KV blocks go back to the
    pool at the engine's next step). The body must already have been read."""

    def on_done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is None:
            for s in streams:
                s.abort()

    watcher = asyncio.create_task(_wait_disconnect(raw))
    watcher.add_done_callback(on_done)
    try:
        yield
    finally:
        watcher.cancel()


def submit_or_error(ctx: ServingContext, prompts: list[tuple[str | None, list[int]]],
                    params: SamplingParams, base_id: str, priority: int,
                    request_id: str) -> list[RequestStream]:
    """``submit_all``, with any failure mapped to its HTTP error."""
    try:
        return submit_all(ctx, prompts, params, base_id, priority)
    except Exception as exc:  # noqa: BLE001 - mapped to 400/503/500
        raise engine_error(exc, ctx, request_id) from None


async def respond(raw: Request, streams: list[RequestStream], ctx: ServingContext,
                  request_id: str, sse: Callable[[], AsyncIterator[str]] | None,
                  body: Callable[[list[RequestOutput]], dict[str, Any]]) -> Response:
    """The endpoint's answer: an SSE response over ``sse()`` when streaming (``sse`` given),
    else the JSON ``body`` of the finished outputs (499 if the client went away first)."""
    if sse is not None:
        return sse_response(sse())
    try:
        finals = await final_outputs(raw, streams)
    except RequestAbortedError:
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc, ctx, request_id) from None
    return JSONResponse(body(finals))


async def final_outputs(raw: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of each stream, aborting all of them if the client disconnects."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        if final is None or not final.finished:
            raise RuntimeError(f"stream {stream.request_id} ended without a finished output")
        return final

    async with abort_on_disconnect(raw, streams):
        try:
            return list(await asyncio.gather(*(last(s) for s in streams)))
        except BaseException:
            for s in streams:
                s.abort()
            raise


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(outputs: list[RequestOutput]) -> dict[str, Any]:
    """Usage over finished outputs (one per prompt): a prompt counts once whatever n is."""
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs),
                 sum(o.num_cached_tokens or 0 for o in outputs))
