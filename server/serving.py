"""What the completions and chat endpoints share: the serving context, model checks (the base
model's served names and the loaded LoRA adapters: ``check_model``, applied in ``submit_all``),
request limits (the engine config's own checks, as 400s naming the request's field), submitting
prompts to the engine, merging streams, the SSE loop of both streaming endpoints
(``stream_events``: each endpoint only says what events one output makes), watching for a
client that went away, and turning engine exceptions into HTTP errors. The server talks to ``AsyncEngine`` only.

Ownership of engine requests: from ``submit_or_error`` on, the endpoint owns its streams and
must abort them on any failure (``aborted_on_error``); once it returns a streaming response, the
response owns them and aborts them however it ends (finished, client gone before or during the
body, a client that stopped reading for ``stream_timeout`` seconds, an error). Abort is a no-op
for a finished stream, so "abort everything at the end" is always safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
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
from engine.params.prompt_image import PromptImage
from engine.params.sampling import SamplingParams
from engine.request_output import RequestOutput
from engine.scheduling.admission import FieldValueError, check_limits, check_priority
from engine.structured.compile_queue import CompileQueueFullError
from server.errors import APIError, bad_request, internal_error
from server.media.limits import MediaSettings
from server.media.prompt import ImagePrompts
from server.metrics import ServerMetrics
from server.middleware import bounded_traceback
from server.prompt_bound import PromptBound
from server.reasoning.formats import ReasoningFormat
from server.sse import DONE, SSEResponse, event
from server.tools.formats import HERMES, ToolCallFormat

logger = logging.getLogger("kvserve.server")


@dataclass
class ServingContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_names: list[str]
    model_root: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    stream_timeout: float = 60.0  # 0: a stalled streaming client is never timed out
    trust_request_chat_template: bool = False
    draining_since: float | None = None  # time.monotonic() when the drain began
    drain_expired: bool = False  # the drain's budget ran out: its aborts end requests properly
    # Tool calling (server/tools): the call format, whether the chat template renders tools
    # itself, and whether tool_choice "auto" is allowed.
    tool_format: ToolCallFormat = HERMES
    tools_native: bool = False
    enable_auto_tool_choice: bool = True
    # Reasoning (server/reasoning): the format a thought is parsed out in (None: none), and the
    # template variables every chat request starts from (--default-chat-template-kwargs).
    reasoning: ReasoningFormat | None = None
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int | None = None  # --reasoning-budget: thought tokens (None: unbounded)
    # Text prompts that surely exceed max_model_len, refused before tokenising (prompt_bound.py).
    prompt_bound: PromptBound | None = None
    # Images in requests (server/media): where they may come from, how many and how large, and
    # how the served model takes them (None: a text-only model; the gate refuses every image).
    media: MediaSettings = field(default_factory=MediaSettings)
    image_prompts: ImagePrompts | None = None

    @property
    def takes_images(self) -> bool:
        return self.image_prompts is not None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's generation-config defaults for fields a request leaves out."""
        defaults = getattr(self.engine, "generation_defaults", None)
        return dict(defaults.values) if defaults is not None else {}

    def lora_names(self) -> list[str]:
        """The loaded LoRA adapters' names, in load order (any of them may be unloaded at any
        await: what a request selected is checked again when it is submitted)."""
        return [name for name, _, _ in self.engine.lora_adapters()]

    def check_model(self, model: str | None) -> str:
        """The model name to report for a request's ``model``: the first served name for the
        base model (no ``model``, or any of its served names), the adapter's own name for a
        loaded LoRA adapter (as vLLM reports it); 404 ``model_not_found`` otherwise. A base
        name wins over an adapter of the same name. What the returned name selects is
        ``lora_of`` it; ``submit_all`` applies it."""
        if model is None or model in self.served_model_names:
            return self.model_name
        adapters = self.lora_names()
        if model in adapters:
            return model
        raise model_not_found(model, self.served_model_names, adapters)

    def lora_of(self, model: str) -> str | None:
        """The LoRA adapter that ``model`` (a name ``check_model`` returned) runs under: None
        for the base model."""
        return None if model in self.served_model_names else model

    def check_limits(self, *, num_prompts: int, n: int, priority: int,
                     logprobs: int | None = None, logprobs_param: str = "logprobs") -> None:
        """400 for a request that no retry can serve: more logprobs than ``max_logprobs``,
        more sequences (``num_prompts x n``) than one request may have or than the whole
        waiting queue holds, or a non-zero ``priority`` under fcfs scheduling
        (``engine.scheduling.admission.check_limits``), named after the request's fields.
        Cheap: called before any prompt is tokenised."""
        try:
            check_limits(self.engine.config, num_prompts=num_prompts, n=n, priority=priority,
                         logprobs=logprobs, logprobs_param=logprobs_param)
        except FieldValueError as exc:
            raise bad_request(str(exc), param=exc.field) from None


# At most this many adapter names are listed in a model_not_found message.
_NAMES_SHOWN = 8


def model_not_found(model: str, served: list[str], adapters: list[str]) -> APIError:
    """The OpenAI-shaped 404 for a ``model`` that is neither a served name of the base model
    nor a loaded LoRA adapter, naming those this server serves."""
    names = ", ".join(repr(n) for n in served)
    if adapters:
        shown = ", ".join(repr(n) for n in adapters[:_NAMES_SHOWN])
        more = f" and {len(adapters) - _NAMES_SHOWN} more" if len(adapters) > _NAMES_SHOWN \
            else ""
        names += f", and the LoRA adapter(s) {shown}{more}"
    return APIError(404, f"The model `{model}` does not exist; this server serves {names}.",
                    type="invalid_request_error", param="model", code="model_not_found")


class RequestFailedError(RuntimeError):
    """The engine ended one request on an internal error of its own (``RequestOutput.error``);
    the engine goes on serving the others. A 500 for that request."""


class RequestRefusedError(ValueError):
    """The engine ended one request because of its own input (``RequestOutput.error_code``:
    e.g. its constraint failed while it ran). A 400 with that code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def check_output(out: RequestOutput) -> RequestOutput:
    """``out``, unless the engine ended its request on an error."""
    if out.error:
        if out.error_code:
            raise RequestRefusedError(out.error, out.error_code)
        raise RequestFailedError(f"request {out.request_id}: {out.error}")
    return out


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
    if isinstance(exc, RequestFailedError):
        logger.error("request_id=%s the engine could not finish: %s", request_id, exc)
        return internal_error(request_id)
    if isinstance(exc, RequestRefusedError):
        return APIError(400, str(exc), code=exc.code)
    if isinstance(exc, CompileQueueFullError):
        ctx.metrics.reject("grammar_queue_full")
        return APIError(503, str(exc), code="grammar_queue_full", headers={"Retry-After": "5"})
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.error("request_id=%s engine error: %s", request_id, bounded_traceback(exc))
    return internal_error(request_id)


def submit_all(ctx: ServingContext, prompts: list[tuple[str | None, list[int]]],
               params: SamplingParams, base_id: str, priority: int = 0, *,
               model: str, images: tuple[PromptImage, ...] = ()) -> list[RequestStream]:
    """Validate every prompt (``engine.check_request``, once: ``submit`` does not repeat it),
    then submit them all; on any failure nothing stays submitted. ``model`` is the name
    ``ctx.check_model`` returned: every request runs under the LoRA adapter it names
    (``SamplingParams.lora_name``), or the base model; an adapter unloaded since the check is
    the 404 ``model_not_found``. The one place where a request's ``model`` reaches its
    params. ``images``: the prompt's images (one prompt), placed by ``server.media.prompt``."""
    engine = ctx.engine
    lora = ctx.lora_of(model)
    if lora != params.lora_name:
        params = params.clone(lora_name=lora)
    if lora is not None and lora not in (adapters := ctx.lora_names()):
        raise model_not_found(lora, ctx.served_model_names, adapters)
    for i, (_, ids) in enumerate(prompts):
        try:
            engine.check_request(ids, params, images=images)
        except ValueError as exc:
            field = getattr(exc, "field", None)  # a sampling field's fault, not the prompt's
            where = f"prompt {i}: " if len(prompts) > 1 and field is None else ""
            raise bad_request(f"{where}{exc}", param=field or "prompt") from None
    check_priority(engine.config, priority)  # a plain ValueError, as from submit itself
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            streams.append(engine.submit(ids, params, f"{base_id}-{i}", prompt=text,
                                         priority=priority, validated=True,  # just above
                                         images=images))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: yields (prompt index, output).

    Pull-based: at most one read is pending per stream and each stream keeps only its newest
    output (outputs are cumulative), so a consumer that stalls (a client that stopped reading)
    holds O(len(streams)) outputs, never a backlog. Ends when every stream has ended; an error
    from any stream is raised. However it ends, every stream is aborted (a no-op once finished).
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    reads: dict[asyncio.Future[RequestOutput], int] = {}

    def read(i: int) -> None:
        reads[asyncio.ensure_future(streams[i].__anext__())] = i

    for i in range(len(streams)):
        read(i)
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=reads.__getitem__):  # prompt order within a wake-up
                i = reads.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                read(i)
    finally:
        for fut in reads:
            if fut.done():
                if not fut.cancelled():
                    fut.exception()  # retrieved: no "exception was never retrieved" warning
            else:
                fut.cancel()
        for s in streams:
            s.abort()


async def stream_events(ctx: ServingContext, raw: Request, streams: list[RequestStream],
                        request_id: str, *,
                        deltas: Callable[[int, RequestOutput], Iterable[str]],
                        closing: Callable[[list[RequestOutput]], Iterable[str]],
                        opening: Iterable[str] = (),
                        failed: Callable[[APIError], Iterable[str]] | None = None,
                        done: bool = True,
                        cut_short: Callable[[], Iterable[str]] | None = None
                        ) -> AsyncIterator[str]:
    """The SSE loop that the streaming endpoints share: ``opening`` events, then for every
    output (prompt index, cumulative output) the events ``deltas`` makes of it, then the events
    ``closing`` makes of the finished outputs (in prompt order; the usage chunk), then
    ``[DONE]`` (unless ``done`` is false: the Responses API sends none). An engine error is
    reported in the stream as ``failed`` makes it (default: the error body, as OpenAI's chat
    does); a client that went away is told nothing. A stream still running when the drain's
    budget ends (``ctx.drain_expired``: SIGTERM) ends with the events ``cut_short`` makes (chat
    and completions: ``finish_reason: "abort"`` for each unfinished choice; default: ``failed``
    of a 503 ``shutting_down``), then ``[DONE]``. However it ends, every stream is aborted
    (frees its blocks)."""
    finals: dict[int, RequestOutput] = {}
    try:
        for e in opening:
            yield e
        async with abort_on_disconnect(raw, streams), \
                contextlib.aclosing(merge_streams(streams)) as merged:
            async for pi, out in merged:
                check_output(out)
                for e in deltas(pi, out):
                    yield e
                if out.finished:
                    finals[pi] = out
        for e in closing([finals[i] for i in sorted(finals)]):
            yield e
    except RequestAbortedError:
        if not ctx.drain_expired:
            return  # the client is gone: nobody to tell
        for e in (cut_short() if cut_short is not None else
                  (failed or _error_events)(shut_down_error())):
            yield e
    except Exception as exc:  # noqa: BLE001 - reported in the stream, as OpenAI does
        error = engine_error(exc, ctx, request_id)
        for e in (failed or _error_events)(error):
            yield e
    finally:
        for s in streams:  # a consumer that stopped early (disconnect) frees its blocks
            s.abort()
    if done:
        yield DONE


def _error_events(error: APIError) -> list[str]:
    return [event(error.body())]


def shut_down_error() -> APIError:
    """What a request still running when the drain's budget ran out gets."""
    return APIError(503, "the server shut down before this request finished; retry on another "
                         "replica or once it is back", code="shutting_down",
                    headers={"Retry-After": "5"})


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


@contextlib.contextmanager
def aborted_on_error(streams: list[RequestStream]) -> Iterator[None]:
    """Abort ``streams`` if the block raises (or is cancelled): between submitting and handing
    the streams to a response, nothing may leave an engine request running for nobody."""
    try:
        yield
    except BaseException:
        for s in streams:
            s.abort()
        raise


# The longest a request waits for its constraint: the vetting's own deadline bounds each
# constraint (structured_outputs_config compile_timeout) and the queue ahead of it is bounded
# (max_pending_compiles); this only guards against a worker that never answers.
COMPILE_WAIT_S = 300.0


def client_of(raw: Request) -> str:
    """The peer address of a request ("" when unknown): whose constraints queue together."""
    return raw.client.host if raw.client is not None else ""


async def check_constraint(ctx: ServingContext, params: SamplingParams, request_id: str,
                           client: str = "") -> None:
    """400 unless the request's structured-output constraint (if any) compiles; compiled into
    the engine's cache on a worker thread, so the engine thread finds it ready. ``client``:
    whose queue it waits in (engine.structured.compile_queue); 503 when that queue is full."""
    spec = params.structured
    if spec is None:
        return
    compile_structured = getattr(ctx.engine, "compile_structured", None)
    if compile_structured is None:
        raise bad_request("structured outputs are not supported by this engine")
    compiling = asyncio.ensure_future(asyncio.to_thread(compile_structured, spec,
                                                        COMPILE_WAIT_S, client))
    try:
        while not compiling.done():  # a drain that runs out ends the wait with a 503
            await asyncio.wait({compiling}, timeout=0.25)
            if ctx.drain_expired and not compiling.done():
                compiling.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise shut_down_error()
        compiling.result()
    except ValueError as exc:
        logger.info("request_id=%s refused constraint %s: %s", request_id, spec.describe(), exc)
        raise bad_request(str(exc)) from None
    except CompileQueueFullError as exc:
        raise engine_error(exc, ctx, request_id) from None
    logger.info("request_id=%s constraint: %s", request_id, spec.describe())


def submit_or_error(ctx: ServingContext, prompts: list[tuple[str | None, list[int]]],
                    params: SamplingParams, base_id: str, priority: int,
                    request_id: str, *, model: str, images: tuple[PromptImage, ...] = ()
                    ) -> list[RequestStream]:
    """``submit_all`` (``model``: what ``ctx.check_model`` returned), with any failure mapped
    to its HTTP error."""
    try:
        return submit_all(ctx, prompts, params, base_id, priority, model=model, images=images)
    except Exception as exc:  # noqa: BLE001 - mapped to 400/503/500
        raise engine_error(exc, ctx, request_id) from None


async def respond(raw: Request, streams: list[RequestStream], ctx: ServingContext,
                  request_id: str, sse: Callable[[], AsyncIterator[str]] | None,
                  body: Callable[[list[RequestOutput]], dict[str, Any]]) -> Response:
    """The endpoint's answer: an SSE response over ``sse()`` when streaming (``sse`` given),
    else the JSON ``body`` of the finished outputs (499 if the client went away first). Either
    way ``streams`` are aborted when the answer ends without finishing them."""
    if sse is not None:
        def abort_all() -> None:
            for s in streams:
                s.abort()

        return SSEResponse(sse(), send_timeout=ctx.stream_timeout or None, on_close=abort_all,
                           request_id=request_id)
    try:
        finals = await final_outputs(raw, streams)
    except RequestAbortedError:
        if ctx.drain_expired:
            raise shut_down_error() from None
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc, ctx, request_id) from None
    return JSONResponse(body(finals))


async def final_outputs(raw: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of each stream, aborting all of them if the client disconnects."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = check_output(out)
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
