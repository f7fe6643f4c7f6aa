"""Token ids of what each endpoint submits: embedding inputs, and Qwen3-Reranker's scoring
template (its model card: a fixed system prefix, ``<Instruct>/<Query>/<Document>`` lines and
an empty thought; the score is softmax over the last token's [no, yes] logits). The prefix,
the pair text and the suffix are tokenised apart, as the card does, so that documents scored
against one query share the prefix cache up to the document."""

from __future__ import annotations

import math
from typing import Any

RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = ("Given a web search query, retrieve relevant passages that answer the "
                       "query")


def rerank_pair_text(query: str, document: str, instruction: str | None = None) -> str:
    return (f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")


def rerank_ids(tokenizer: Any, query: str, document: str, instruction: str | None = None,
               truncate: int | None = None) -> list[int]:
    """The card's input: prefix + pair text (cut to ``truncate`` tokens) + suffix."""
    enc = tokenizer.encode
    body = enc(rerank_pair_text(query, document, instruction), add_special_tokens=False)
    if truncate is not None:
        body = body[:truncate]
    return (enc(RERANK_PREFIX, add_special_tokens=False) + body
            + enc(RERANK_SUFFIX, add_special_tokens=False))


def yes_probability(logits: list[float]) -> float:
    """softmax over the [no, yes] logits, the "yes" share."""
    no, yes = logits
    return 1.0 / (1.0 + math.exp(no - yes))


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0
