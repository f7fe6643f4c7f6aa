"""The routes: ``POST /v1/embeddings``, ``POST /v1/rerank`` (also ``/rerank``, ``/v2/rerank``)
and ``POST /v1/score``.

Every input becomes one engine request with ``SamplingParams.pooling`` set (prefill only,
one vector back), scheduled beside generation. Embeddings pool as the model says
(``AsyncEngine.pooling``). Rerank and score: with ``task="score"`` each (query, document)
pair is put in Qwen3-Reranker's template and scored by its last token's [no, yes] logits;
with ``task="embed"`` by the cosine of the two embeddings; a generative model refuses them
(400). Limits as for completions: the number of inputs (``max_num_seqs`` per request, the
waiting queue), each input's tokens (``max_model_len``), texts refused by their length before
tokenising; every 400 names the field.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine.params.pooling import PoolingParams
from engine.params.sampling import SamplingParams
from engine.request_output import RequestOutput
from engine.scheduling.admission import FieldValueError, check_limits
from server.embeddings.prompts import cosine, rerank_ids, yes_probability
from server.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from server.embeddings.writer import embeddings_body, rerank_body, score_body
from server.errors import APIError, bad_request
from server.prompt_bound import check_chars, release_after
from server.serving import (
    ServingContext,
    new_id,
    request_id_of,
    respond,
    submit_or_error,
)

logger = logging.getLogger("kvserve.server")
Prompts = list[tuple[str | None, list[int]]]


def add_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await create_embeddings(ctx, req, raw)

    async def rerank(req: RerankRequest, raw: Request) -> Response:
        return await create_rerank(ctx, req, raw)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path)(rerank)

    @app.post("/v1/score")
    async def score(req: ScoreRequest, raw: Request) -> Response:
        return await create_score(ctx, req, raw)


def _pooling(ctx: ServingContext):
    pooling = getattr(ctx.engine, "pooling", None)
    if pooling is None:
        raise APIError(501, "this engine does not serve pooling requests")
    if ctx.engine.config.kv_eviction is not None:  # positions move under streaming eviction
        raise bad_request("embeddings, rerank and score are not served with --kv-eviction",
                          param="model")
    return pooling


def _limits(ctx: ServingContext, num: int, field: str) -> None:
    try:
        check_limits(ctx.engine.config, num_prompts=num, n=1, priority=0)
    except FieldValueError as exc:
        raise bad_request(f"{field}: {exc}".replace(" prompts x n=1 =", " inputs ="),
                          param=field) from None


def _check_prompts(ctx: ServingContext, prompts: Prompts, params: SamplingParams,
                   field: str) -> None:
    for i, (_, ids) in enumerate(prompts):
        try:
            ctx.engine.check_request(ids, params)
        except ValueError as exc:
            where = f"{field}[{i}]" if len(prompts) > 1 else field
            raise bad_request(f"{where}: {exc}", param=field) from None


def _encode(ctx: ServingContext, texts: list[str | list[int]], field: str,
            add_special_tokens: bool, truncate: int | None) -> Prompts:
    if truncate is None:
        for t in texts:
            if isinstance(t, str):
                check_chars(ctx.prompt_bound, len(t), field)
    out: Prompts = []
    for t in texts:
        if isinstance(t, str):
            ids = list(ctx.tokenizer.encode(t, add_special_tokens=add_special_tokens))
            release_after(len(t))
            text: str | None = t
        else:
            ids, text = list(t), None
        if truncate is not None:
            ids = ids[-truncate:]  # vLLM keeps the last tokens
        out.append((text, ids))
    return out


async def _run(ctx: ServingContext, raw: Request, prompts: Prompts, params: SamplingParams,
               field: str, prefix: str, body, model: str) -> Response:
    """Submit ``prompts`` under ``model`` (what ``ctx.check_model`` returned: the base model
    or a LoRA adapter) and answer ``body(rid, finals)``."""
    xrid = request_id_of(raw)
    _check_prompts(ctx, prompts, params, field)
    rid = new_id(prefix)
    streams = submit_or_error(ctx, prompts, params, rid, 0, xrid, model=model)
    logger.info("request_id=%s %s: %d input(s), %d tokens", xrid, rid, len(prompts),
                sum(len(ids) for _, ids in prompts))
    return await respond(raw, streams, ctx, xrid, None, lambda finals: body(rid, finals))


async def create_embeddings(ctx: ServingContext, req: EmbeddingRequest, raw: Request
                            ) -> Response:
    model = ctx.check_model(req.model)
    pooling = _pooling(ctx)
    if req.dimensions is not None and req.dimensions > pooling.hidden_size:
        raise bad_request(f"dimensions: {req.dimensions} is more than the model's "
                          f"{pooling.hidden_size} features", param="dimensions")
    texts = req.inputs()
    _limits(ctx, len(texts), "input")
    prompts = await asyncio.to_thread(_encode, ctx, texts, "input", req.add_special_tokens,
                                      req.truncate_prompt_tokens)
    rule = pooling.rule
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(
        rule.method, rule.normalize, req.dimensions))

    def body(rid: str, finals: list[RequestOutput]) -> dict[str, Any]:
        return embeddings_body(rid, model, finals, req.encoding_format)

    return await _run(ctx, raw, prompts, params, "input", "embd", body, model)


async def _pair_scores(ctx: ServingContext, raw: Request, pairs: list[tuple[str, str]],
                       instruction: str | None, truncate: int | None, field: str,
                       prefix: str, make_body, model: str) -> Response:
    """Score (query, document) pairs: the reranker's yes/no template, or the cosine of the
    two embeddings; ``make_body(rid, scores, finals)``."""
    pooling = _pooling(ctx)
    if pooling.task == "generate":
        raise bad_request("this model is served for generation: start the server with "
                          "--task score (a yes/no reranker such as Qwen3-Reranker) or "
                          "--task embed (scores by embedding cosine) to rerank or score",
                          param="model")
    _limits(ctx, len(pairs) if pooling.task == "score" else len(pairs) + 1, field)
    if pooling.task == "score":
        def encode() -> Prompts:
            tok = ctx.tokenizer
            out = []
            for q, d in pairs:
                check_chars(ctx.prompt_bound, len(q) + len(d), field)
                out.append((None, rerank_ids(tok, q, d, instruction, truncate)))
            return out

        prompts = await asyncio.to_thread(encode)
        params = SamplingParams(max_tokens=1, pooling=PoolingParams(
            "last", normalize=False, head_token_ids=pooling.score_token_ids))

        def body(rid: str, finals: list[RequestOutput]) -> dict[str, Any]:
            return make_body(rid, [yes_probability(o.pooled) for o in finals], finals)

        return await _run(ctx, raw, prompts, params, field, prefix, body, model)
    # embed: one vector per distinct text, scores by cosine
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    _limits(ctx, len(texts), field)
    prompts = await asyncio.to_thread(_encode, ctx, texts, field, True, truncate)
    rule = pooling.rule
    params = SamplingParams(max_tokens=1, pooling=PoolingParams(rule.method, rule.normalize))

    def body(rid: str, finals: list[RequestOutput]) -> dict[str, Any]:
        vec = {t: o.pooled for t, o in zip(texts, finals, strict=True)}
        return make_body(rid, [cosine(vec[q], vec[d]) for q, d in pairs], finals)

    return await _run(ctx, raw, prompts, params, field, prefix, body, model)


async def create_rerank(ctx: ServingContext, req: RerankRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    docs = req.texts()
    pairs = [(req.query, d) for d in docs]

    def make_body(rid: str, scores: list[float], finals: list[RequestOutput]):
        return rerank_body(rid, model, docs, scores, req.top_n, req.return_documents, finals)

    return await _pair_scores(ctx, raw, pairs, req.instruction, req.truncate_prompt_tokens,
                              "documents", "rerank", make_body, model)


async def create_score(ctx: ServingContext, req: ScoreRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)

    def make_body(rid: str, scores: list[float], finals: list[RequestOutput]):
        return score_body(rid, model, scores, finals)

    return await _pair_scores(ctx, raw, req.pairs(), req.instruction,
                              req.truncate_prompt_tokens, "text_2", "score", make_body, model)
