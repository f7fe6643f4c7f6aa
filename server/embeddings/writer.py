"""Response bodies: OpenAI's embeddings list (floats or base64 of little-endian float32, as
the ``openai`` SDK decodes it), Jina/Cohere rerank results, vLLM's score list."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from engine.request_output import RequestOutput


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return {"prompt_tokens": prompt, "total_tokens": prompt,
            "prompt_tokens_details": {"cached_tokens": cached}}


def embeddings_body(rid: str, model: str, outputs: list[RequestOutput],
                    encoding_format: str) -> dict[str, Any]:
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encode_vector(o.pooled or [], encoding_format)}
                     for i, o in enumerate(outputs)],
            "usage": usage(outputs)}


def rerank_body(rid: str, model: str, documents: list[str], scores: list[float],
                top_n: int | None, return_documents: bool,
                outputs: list[RequestOutput]) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n:
        order = order[:top_n]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            r["document"] = {"text": documents[i]}
        results.append(r)
    return {"id": rid, "model": model, "usage": usage(outputs), "results": results}


def score_body(rid: str, model: str, scores: list[float],
               outputs: list[RequestOutput]) -> dict[str, Any]:
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": usage(outputs)}
