"""vLLM's renderer API: ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``
answer with the token ids a request's prompt becomes and the sampling parameters it carries,
without generating anything.

vllm-router (``kv_aware``) asks a worker for them before routing each request, to hash the
prompt's KV blocks the way the worker will; without them it got a 404 and asked ``/tokenize``
next, two round trips per request. The token ids are those the real request would run on:
the same tokenisation (completions) and the same chat rendering, tools and template arguments
included (chat), and the same 400s for a request the real endpoint would refuse. Shapes, as
vLLM answers: a list of ``GenerateRequest`` objects for completions (one per prompt), one object
for chat, each ``{"request_id", "model", "token_ids", "sampling_params", "cache_salt"}``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.params.sampling import SamplingParams
from server.chat import chat_prompt
from server.completions import tokenize_prompts
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.serving import ServingContext, client_of, new_id, request_id_of

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "seed", "max_tokens",
                    "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
                    "skip_special_tokens")


def sampling_json(params: SamplingParams) -> dict[str, Any]:
    """The plain sampling fields of ``params`` as vLLM names them in a ``GenerateRequest``."""
    return {name: getattr(params, name) for name in _SAMPLING_FIELDS}


def _generate_request(rid: str, model: str, ids: list[int], params: SamplingParams
                      ) -> dict[str, Any]:
    return {"request_id": rid, "model": model, "token_ids": ids,
            "sampling_params": sampling_json(params), "cache_salt": params.cache_salt}


def add_routes(app: FastAPI, ctx: ServingContext) -> None:
    """``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``."""

    @app.post("/v1/completions/render")
    async def render_completion(req: CompletionRequest) -> JSONResponse:
        model = ctx.check_model(req.model)
        ctx.check_limits(num_prompts=len(req.prompts()), n=req.n, priority=req.priority,
                         logprobs=req.logprobs)
        prompts = await asyncio.to_thread(tokenize_prompts, ctx, req)
        try:
            params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs,
                                         defaults=ctx.sampling_defaults)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        cid = new_id("cmpl")
        return JSONResponse([_generate_request(f"{cid}-{i}", model, ids, params)
                             for i, (_, ids) in enumerate(prompts)])

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(req: ChatCompletionRequest, raw: Request
                                     ) -> JSONResponse:
        model = ctx.check_model(req.model)
        prompt = await chat_prompt(ctx, req, request_id_of(raw), client_of(raw))
        return JSONResponse(_generate_request(new_id("chatcmpl"), model, prompt.ids,
                                              prompt.params))
