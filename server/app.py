"""``build_app(engine, settings)``: the FastAPI application around an :class:`AsyncEngine`.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/version``, ``/tokenize``, ``/detokenize``, ``/metrics``. The app owns no model code; the
engine's own thread runs it. On lifespan shutdown (after uvicorn stopped accepting connections
and let those in flight finish, bounded by its graceful-shutdown timeout) the engine is stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from server.chat import create_chat_completion, render_chat
from server.completions import create_completion
from server.config_file import ServerSettings
from server.errors import APIError, bad_request, install_error_handlers
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.middleware import RequestContextMiddleware
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.serving import ServingContext


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        return pkg_version("kvserve")
    except PackageNotFoundError:  # running from a source tree
        return "0.1.0"


def build_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    metrics = ServerMetrics(engine.model_name, engine.stats, lambda: engine.is_healthy)
    engine.observers.append(metrics)
    ctx = ServingContext(engine=engine, metrics=metrics,
                         served_model_names=[engine.model_name],
                         model_root=engine.config.model)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown(timeout=settings.shutdown_timeout)

    app = FastAPI(title="kvserve", version=version(), lifespan=lifespan)
    app.state.ctx = ctx
    app.state.engine = engine
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, api_key=settings.api_key,
                       log_requests=not settings.disable_log_requests)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return Response(status_code=200)
        return APIError(503, "the engine is not running", code="engine_dead").response()

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": ctx.created, "owned_by": "kvserve",
             "root": ctx.model_root or name, "parent": None,
             "max_model_len": engine.max_model_len}
            for name in ctx.served_model_names]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        ctx.check_model(req.model)
        tok = ctx.tokenizer
        if req.messages is not None:
            try:
                _, ids = render_chat(tok, [{"role": "system" if m.role == "developer" else
                                            m.role, "content": m.text()} for m in req.messages],
                                     add_generation_prompt=req.add_generation_prompt)
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
        else:
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len,
                                "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = tok.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(req.model)
        vocab = getattr(engine.core, "vocab_size", None) or len(ctx.tokenizer)
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                              param="tokens")
        return JSONResponse({"prompt": ctx.tokenizer.decode(req.tokens)})

    return app
