"""Streaming past the context (``--kv-eviction sink:S,window:N``): how much does a long text's
perplexity suffer when the model only keeps the sinks and a window, in bounded memory?

StreamingLLM's measurement (Xiao et al., 2023, Fig. 3) through kvserve's engine: a fixed long
text (CPython's ``LICENSE.txt``, or ``--text-file``) is decoded token by token with every next
token FORCED to the text's, so the engine runs its real streaming path over a known sequence, on
three engines: ``off`` (no eviction, a long enough context), ``sink:S,window:N`` (StreamingLLM at
``--max-model-len``) and ``sink:0,window:N`` (the window alone: StreamingLLM's failing
baseline). Per engine: the most KV blocks held, blocks evicted, the largest log-prob difference
from ``off`` before the first eviction, and the perplexity from position ``--max-model-len`` on
and over the last ``--tail`` tokens. Heavy imports happen inside the functions.

    kvserve bench streaming     # SmolLM2-135M, 1536 forced tokens, max_model_len 512
    kvserve bench streaming --tokens 200 --max-model-len 128 --window 64  # smoke"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
PROMPT_TOKENS = 16  # the text's first tokens are the prompt; the rest is forced


class ForcingSampler:
    """Stands in for the engine's sampler for one sequence: returns the text's next token and
    records the log-prob the model gave it."""

    def __init__(self, targets: list[int]) -> None:
        self.targets = targets
        self.logprobs: list[float] = []

    def __call__(self, logits: Any, rows: Any) -> Any:
        import torch

        from engine.sampling.sampler import SamplerOutput

        if logits.shape[0] != 1:
            raise ValueError("forced decoding runs one sequence")
        target = self.targets[len(self.logprobs)]
        self.logprobs.append(float(torch.log_softmax(logits[0].float(), -1)[target]))
        return SamplerOutput([target], None, None, None)


@dataclass
class Row:
    engine: str
    max_model_len: int
    peak_blocks: int
    evicted_blocks: int
    seconds: float
    logprobs: list[float] = field(repr=False)  # of text token PROMPT_TOKENS + i
    max_diff_before_eviction: float = 0.0
    ppl_past_context: float = 0.0
    ppl_tail: float = 0.0


def forced_decode(llm: Any, ids: list[int]) -> tuple[list[float], int, float]:
    """Decode ``ids`` after its first PROMPT_TOKENS, every token forced; returns (log-probs,
    most live blocks, seconds)."""
    from engine import SamplingParams

    core = llm.engine
    forcing = ForcingSampler(ids[PROMPT_TOKENS:])
    core.sampler, own = forcing, core.sampler
    try:
        core.add_request("t", ids[:PROMPT_TOKENS], SamplingParams(
            temperature=0, max_tokens=len(ids) - PROMPT_TOKENS, ignore_eos=True))
        peak, start = 0, time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            peak = max(peak, core.kv.num_live_blocks("t"))
    finally:
        core.sampler = own
    return forcing.logprobs, peak, time.perf_counter() - start


def _ppl(lps: list[float]) -> float:
    return math.exp(-sum(lps) / len(lps))


def measure(model: str | None = None, tokens: int = 1536, max_model_len: int = 512,
            sink: int = 4, window: int = 256, tail: int = 512, block_size: int = 16,
            text_file: Path = DEFAULT_TEXT) -> list[Row]:
    """The three engines' rows: off, sink:S,window:N and sink:0,window:N."""
    from engine import LLM, SamplingParams

    full_len = 1 << (tokens + PROMPT_TOKENS).bit_length()
    kv = "256MiB"  # per engine (the default, a share of RAM, three times over is too much)
    engines = {"off": dict(max_model_len=full_len)}
    for s in (sink, 0):
        engines[f"sink:{s},window:{window}"] = dict(max_model_len=max_model_len,
                                                     kv_eviction=f"sink:{s},window:{window}")
    rows: list[Row] = []
    ids: list[int] = []
    for name, cfg in engines.items():
        llm = LLM(model, kv_cache_memory=kv, block_size=block_size, **cfg)
        if not ids:
            ids = llm.engine.tokenizer.encode(Path(text_file).read_text())
            ids = ids[:tokens + PROMPT_TOKENS]
        llm.generate([ids[:PROMPT_TOKENS]], SamplingParams(max_tokens=4))  # warm-up
        lps, peak, secs = forced_decode(llm, ids)
        rows.append(Row(name, cfg["max_model_len"], peak,
                        llm.stats()["num_blocks_evicted_stream"], secs, lps))
        del llm
    if len(ids) < tokens + PROMPT_TOKENS:
        raise ValueError(f"{text_file} has only {len(ids)} tokens")
    off = rows[0].logprobs
    for r in rows:
        # The first eviction comes before computing cache position (S + W + 1) * block_size.
        s_blocks = -(-sink // block_size) if r.engine.startswith(f"sink:{sink},") else 0
        first = (s_blocks + -(-window // block_size) + 1) * block_size - PROMPT_TOKENS
        n = first if r.engine != "off" else len(off)
        r.max_diff_before_eviction = max(abs(a - b) for a, b in zip(r.logprobs[:n], off[:n]))
        r.ppl_past_context = _ppl(r.logprobs[max_model_len - PROMPT_TOKENS:])
        r.ppl_tail = _ppl(r.logprobs[-tail:])
    return rows


def format_table(rows: list[Row], tokens: int, max_model_len: int, tail: int) -> str:
    lines = [f"{tokens} forced tokens after a {PROMPT_TOKENS}-token prompt; eviction engines at "
             f"max_model_len {max_model_len}",
             f"| engine | max_model_len | peak blocks | evicted blocks | max abs log-prob diff "
             f"vs off before the first eviction | PPL of tokens {max_model_len}.. | PPL of the "
             f"last {tail} | s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.engine} | {r.max_model_len} | {r.peak_blocks} | {r.evicted_blocks} "
                     f"| {r.max_diff_before_eviction:.2g} | {r.ppl_past_context:.2f} | "
                     f"{r.ppl_tail:.2f} | {r.seconds:.0f} |")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """``kvserve bench streaming``: the table of docs/performance.md's "Streaming past the
    context"."""
    p = sub.add_parser("streaming", help="perplexity past the context with --kv-eviction "
                                         "(StreamingLLM's measurement)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--tail", type=int, default=512)
    p.add_argument("--text-file", type=Path, default=DEFAULT_TEXT)
    p.set_defaults(func=main_from_args)


def main_from_args(args: argparse.Namespace) -> int:
    rows = measure(args.model, args.tokens, args.max_model_len, args.sink, args.window,
                   args.tail, text_file=args.text_file)
    print(format_table(rows, args.tokens, args.max_model_len, args.tail))
    return 0
