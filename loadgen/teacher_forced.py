"""Teacher-forced measurements of an engine against a token sequence, shared by the model
tests and benchmarks/kv_quant.py: one prefill with prompt logprobs gives, at every position,
the rank and log-prob the engine gives the true next token."""

from __future__ import annotations

import math
from collections.abc import Iterable

from engine import LLM, SamplingParams

# The fixed text the perplexity figures of the tests and the README are measured on.
TEXT = (
    "The lighthouse stood at the end of a narrow spit of rock, and for forty years the same "
    "family had kept its lamp burning. Every evening the keeper climbed the spiral stairs, "
    "trimmed the wick, polished the great lens and wrote the weather in a leather book. Ships "
    "passed in the dark without ever knowing his name. In winter the storms came from the "
    "north and the spray reached the gallery rail; in summer the fog rolled in so thick that "
    "he rang the bell by hand through the night. When the harbour board installed an electric "
    "lamp and a clockwork that needed no one, the keeper packed his books, locked the door "
    "and walked along the causeway to the village, where children asked him what the sea "
    "looked like from the top. He told them it looked like a field of moving glass, and that "
    "the stars were closer there than anywhere else on earth."
)


def forced(llm: LLM, ids: list[int], start: int = 1,
           lora_name: str | None = None) -> list[tuple[int, float]]:
    """(rank, log-prob) of ``ids[p]`` given ``ids[:p]``, for ``p`` from ``start`` on (under
    LoRA adapter ``lora_name``, when given)."""
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1,
                                             lora_name=lora_name))[0]
    return [(out.prompt_logprobs[p][ids[p]].rank, out.prompt_logprobs[p][ids[p]].logprob)
            for p in range(start, len(ids))]


def top1(llm: LLM, ids: list[int]) -> list[bool]:
    """Whether each token after the first is the engine's top-1 given what precedes it."""
    return [rank == 1 for rank, _ in forced(llm, ids)]


def continuation_hits(llm: LLM, pairs: Iterable[tuple[list[int], list[int]]],
                      lora_name: str | None = None) -> tuple[int, int]:
    """Over (prompt, continuation) pairs: continuation tokens that are the engine's top-1
    given everything before them (under adapter ``lora_name``, when given), and how many
    continuation tokens there are."""
    hits = total = 0
    for prompt, cont in pairs:
        ranks = forced(llm, prompt + cont, start=len(prompt), lora_name=lora_name)
        hits += sum(rank == 1 for rank, _ in ranks)
        total += len(ranks)
    return hits, total


def perplexity(llm: LLM, ids: list[int]) -> float:
    return perplexity_of(forced(llm, ids))


def perplexity_of(ranked: list[tuple[int, float]]) -> float:
    return math.exp(-sum(lp for _, lp in ranked) / len(ranked))
