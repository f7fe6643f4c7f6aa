"""``build_app(engine, settings)``: the FastAPI application around an :class:`AsyncEngine`.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (server/responses),
``/v1/messages`` and ``/v1/messages/count_tokens`` (server/anthropic), ``/v1/models``,
``/v1/models/{id}``, ``/health``, ``/version``, ``/tokenize``, ``/detokenize``, ``/metrics``, the
KV page (server/kv_page/, off with ``--no-kv-page``), with ``--profiler-dir`` the profiler's
(server/profile_routes.py), with ``--allow-runtime-lora-updating`` the LoRA load/unload routes
(server/lora_routes.py; ``/v1/models`` lists the loaded adapters after the base model), and
the endpoints routers probe (server/router_routes.py). The app
owns no model code; the engine's own thread runs it, and tokenising runs on worker threads:
the event loop only parses, validates and frames. ``/health`` answers ``{"status": "ok"}``
while serving; ``/openapi.json`` documents the errors as sent (server/openapi_errors.py).
Draining (:func:`begin_drain`, on SIGTERM by ``run_server``): new requests and ``/health`` get
503 and the requests in flight may finish. The drain is bounded ONCE, by ``shutdown_timeout``
from its start: the server's graceful wait (server/graceful.py) and the engine's final wait at
lifespan shutdown share that one budget; what still runs at its end is ended properly
(:func:`end_drain`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from engine.chat_template import render_chat
from server.anthropic.endpoint import add_routes as add_anthropic_routes
from server.anthropic.errors import AnthropicMiddleware
from server.chat import create_chat_completion
from server.completions import create_completion
from server.config_file import ServerSettings
from server.connections import ConnectionTracker
from server.embeddings.endpoint import add_routes as add_embeddings_routes
from server.errors import APIError, bad_request, install_error_handlers
from server.http_framing import FramingMiddleware
from server.media.check import checked_images
from server.media.collect import chat_image_refs
from server.media.prompt import image_prompts
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.middleware import BodySizeLimitMiddleware, RequestContextMiddleware
from server.openapi_errors import install as install_openapi_errors
from server.overload import OverloadMiddleware
from server.prompt_bound import prompt_bound, release_after
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    conversation,
)
from server.reasoning.formats import choose_reasoning
from server.render_routes import add_routes as add_render_routes
from server.responses.endpoint import add_routes as add_responses_routes
from server.responses.store import ResponseStore
from server.router_routes import add_routes as add_router_routes
from server.serving import ServingContext, model_not_found
from server.tools.formats import choose_format
from server.tools.prompt import renders_tools, template_source, tool_conversation

logger = logging.getLogger("kvserve.server")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        return pkg_version("kvserve")
    except PackageNotFoundError:  # running from a source tree
        return "0.1.0"


def begin_drain(app: FastAPI) -> None:
    """Start the graceful shutdown (idempotent): refuse new requests, answer 503 on /health,
    and start the clock of the one ``shutdown_timeout`` budget."""
    ctx: ServingContext = app.state.ctx
    if ctx.draining_since is None:
        ctx.draining_since = time.monotonic()
    app.state.engine.begin_drain()


def end_drain(app: FastAPI) -> int:
    """The drain's budget is spent: every request still running ends now, a stream with its
    endpoint's "abort" ending (chat and completions: a chunk with ``finish_reason: "abort"``)
    and ``[DONE]``, a non-streaming request with a 503 (``shutting_down``). Returns how many
    engine requests were aborted."""
    ctx: ServingContext = app.state.ctx
    begin_drain(app)
    ctx.drain_expired = True
    return app.state.engine.abort_all()


def drain_time_left(app: FastAPI) -> float:
    """Seconds left of the drain budget (the whole ``shutdown_timeout`` if none began)."""
    ctx: ServingContext = app.state.ctx
    timeout = app.state.settings.shutdown_timeout
    if ctx.draining_since is None:
        return timeout
    return max(0.0, timeout - (time.monotonic() - ctx.draining_since))


def build_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    metrics = ServerMetrics(engine.model_name, engine.stats, lambda: engine.is_healthy,
                            kv_cache_dtype=engine.config.kv_cache_dtype,
                            cache_config={"block_size": str(engine.config.block_size),
                                          "enable_prefix_caching":
                                          str(engine.config.enable_prefix_caching)})
    engine.observers.append(metrics)
    ctx = ServingContext(engine=engine, metrics=metrics,
                         served_model_names=[engine.model_name, *(
                             n for n in engine.config.served_model_names
                             if n != engine.model_name)],
                         model_root=engine.config.model,
                         stream_timeout=settings.stream_timeout,
                         trust_request_chat_template=settings.trust_request_chat_template,
                         enable_auto_tool_choice=settings.enable_auto_tool_choice,
                         media=settings.media_settings(),
                         image_prompts=image_prompts(engine))
    ctx.prompt_bound = prompt_bound(engine.tokenizer, engine.max_model_len)
    template = template_source(engine.tokenizer)
    ctx.tool_format, why = choose_format(template, settings.tool_call_parser)
    ctx.tools_native = renders_tools(template)
    logger.info("tool calls: the %s format (%s); tools are rendered by %s",
                ctx.tool_format.name, why, "the chat template" if ctx.tools_native else
                "kvserve's default tool prompt (the chat template has no tools)")
    ctx.reasoning, why = choose_reasoning(template, settings.reasoning_parser)
    ctx.default_template_kwargs = dict(settings.default_chat_template_kwargs or {})
    ctx.reasoning_budget = settings.reasoning_budget if settings.reasoning_budget >= 0 else None
    logger.info("reasoning: %s (%s)", f"the {ctx.reasoning.name} parser: thoughts go to "
                f"reasoning_content" if ctx.reasoning else "off, outputs are all content", why)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        timeout = drain_time_left(app)  # what uvicorn's graceful wait left of the budget
        begin_drain(app)
        await engine.shutdown(timeout=timeout)

    app = FastAPI(title="kvserve", version=version(), lifespan=lifespan)
    app.state.ctx = ctx
    app.state.engine = engine
    app.state.settings = settings
    install_error_handlers(app)
    install_openapi_errors(app)
    # Added first = innermost: the API key is checked (and the request id set) before any body
    # is read.
    app.add_middleware(BodySizeLimitMiddleware, max_body_size=settings.max_request_body_size)
    app.add_middleware(FramingMiddleware)  # Content-Length with Transfer-Encoding: 400
    # The connections' shared state (server/connections.py; given to uvicorn by run_server).
    app.state.connections = ConnectionTracker(settings.header_timeout, settings.body_timeout,
                                              settings.max_connections_per_client)
    app.add_middleware(OverloadMiddleware, limit=settings.limit_concurrency,
                       tracker=app.state.connections)
    app.add_middleware(RequestContextMiddleware, api_key=settings.api_key,
                       log_requests=not settings.disable_log_requests)
    # Outermost: on /v1/messages... every error in Anthropic's shape, and x-api-key taken.
    app.add_middleware(AnthropicMiddleware, api_key=settings.api_key)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_healthy:  # why (engine.dead_reason) is in the log, not shown here
            return APIError(503, "the engine is not running", code="engine_dead").response()
        if ctx.draining_since is not None:
            return APIError(503, "the server is shutting down", code="shutting_down",
                            headers={"Retry-After": "5"}).response()
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card(name: str, root: str | None = None, parent: str | None = None
                   ) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": ctx.created, "owned_by": "kvserve",
                "root": root or ctx.model_root or name, "parent": parent,
                "max_model_len": engine.max_model_len}

    def adapter_cards() -> dict[str, dict[str, Any]]:
        """A card per loaded LoRA adapter (vLLM's: ``root`` its path, ``parent`` the base
        model's reported name), by name, in load order."""
        return {name: model_card(name, path, ctx.model_name)
                for name, path, _ in engine.lora_adapters() if name not in ctx.served_model_names}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """The base model's served names, then each loaded LoRA adapter."""
        return {"object": "list", "data": [*(model_card(n) for n in ctx.served_model_names),
                                           *adapter_cards().values()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        model = ctx.check_model(model_id)  # 404 for a model this server does not serve
        if ctx.lora_of(model) is None:
            return model_card(model_id)
        card = adapter_cards().get(model)
        if card is None:  # unloaded since the check
            raise model_not_found(model_id, ctx.served_model_names, ctx.lora_names())
        return card

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    app.state.responses_store = ResponseStore(settings.responses_store_max_items,
                                              settings.responses_store_max_bytes)
    add_responses_routes(app, ctx, app.state.responses_store)
    add_anthropic_routes(app, ctx)  # the Messages API (server/anthropic)
    add_embeddings_routes(app, ctx)  # /v1/embeddings, /v1/rerank, /v1/score (server/embeddings)
    add_router_routes(app, ctx, settings, version())  # what sglang-router / vllm-router probe
    add_render_routes(app, ctx)  # vLLM's renderer API: a request's token ids (vllm-router)
    _log_lora(ctx)
    if settings.allow_runtime_lora_updating:
        from server.lora_routes import add_routes as add_lora_routes

        add_lora_routes(app, ctx)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        logger.warning("runtime LoRA updating is on: clients may load any adapter path this "
                       "server can read (POST /v1/load_lora_adapter%s)",
                       "" if settings.api_key else "; no --api-key is set")
    if settings.kv_page:
        from server.kv_page.routes import add_routes as add_kv_page_routes

        add_kv_page_routes(app, engine)
    if settings.profiler_dir:
        from server.profile_routes import add_routes as add_profile_routes

        add_profile_routes(app, engine, settings.profiler_dir, settings.profiler_max_seconds,
                           settings.profiler_max_iters)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        model = ctx.check_model(req.model)
        await checked_images(chat_image_refs, req.messages or [], ctx.media, model=model,
                             takes_images=ctx.takes_images)
        # Off the event loop: a megabyte of text takes the tokenizer a second or more.
        return JSONResponse(await asyncio.to_thread(_tokenize, ctx, req))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(req.model)
        return JSONResponse(await asyncio.to_thread(_detokenize, ctx, req))

    return app


def _log_lora(ctx: ServingContext) -> None:
    """State the LoRA adapters served from the start; warn about one that a served name of the
    base model hides (a request naming it gets the base model)."""
    adapters = ctx.engine.lora_adapters()
    if adapters:
        logger.info("LoRA adapters: %s", ", ".join(f"{n} ({p})" for n, p, _ in adapters))
    hidden = [n for n, _, _ in adapters if n in ctx.served_model_names]
    if hidden:
        logger.warning("LoRA adapter(s) %s have a served name of the base model: requests "
                       "naming them get the base model; give them other names",
                       ", ".join(repr(n) for n in hidden))


def _tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict[str, Any]:
    tok = ctx.tokenizer
    if req.messages is not None:
        try:
            messages, _ = tool_conversation(conversation(req.messages), None, ctx.tool_format,
                                            ctx.tools_native)
            images = ctx.image_prompts is not None and any(m.has_images for m in req.messages)
            text, ids = render_chat(tok, messages,
                                    add_generation_prompt=req.add_generation_prompt,
                                    expand=ctx.image_prompts.expand if images else None)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
    else:
        text = req.prompt
        ids = list(tok.encode(text, add_special_tokens=req.add_special_tokens))
    release_after(len(text))
    body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.engine.max_model_len,
                            "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tok.convert_ids_to_tokens(ids)
    return body


def _detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict[str, Any]:
    vocab = ctx.engine.token_id_bound
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                          param="tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}
