"""Activation precision on the embedded SmolLM2-135M Q4_1 file (issue 65), in one run: the
default (``--activation-precision auto``: the faithful kernels), ``int8`` (llama.cpp's int8
activation groups) and ``--quantization none`` (the same weights dequantised, float32).

For each configuration: teacher-forced top-1 agreement with HF transformers' float32 forward
pass over the same file (dequantised by ``gguf``), pooled over the ten held-out paragraphs of
``loadgen.heldout_text.HELD_OUT`` (each its own sequence, cut to ``--tokens``; tokenised
by HF's tokenizer from the file, the ids fed to both); decode TPOT at 1 row and throughput at 16
rows ((time of 1 + N generated tokens - time of 1 token) / N, greedy, ``ignore_eos``, the
configurations interleaved, the best of ``--reps``); prefill tokens/s of a fresh
``--prefill``-token prompt (random ids, one output token; best of ``--reps``); which activation
precision each engine serves (``auto``'s choice); and the README's example ("What is the
capital of France?", chat, temperature 0) answer, with its first token's top three
probabilities. Every engine is built as ``kvserve serve`` builds it (float32 weights, the KV
pool float16 on a CPU) but for its configuration's fields.

    PYTHONPATH=. python benchmarks/activation_precision.py [--tokens 128] [--decode 32]
        [--prefill 512] [--reps 2] [--cpu-probe off] [--configs NAME ...] [--no-timing] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from benchmarks.startup_time import isa
from engine import LLM, SamplingParams
from loadgen.serve import machine_info

CONFIGS = {
    "default (auto)": {},
    "float32 activations": {"activation_precision": "float32"},
    "bf16 activations": {"activation_precision": "bf16"},
    "int8 activations": {"activation_precision": "int8"},
    "int8 activations, float32 KV": {"activation_precision": "int8", "kv_cache_dtype": "float32"},
    "quantization=none": {"quantization": "none"},
}
QUESTION = "What is the capital of France?"


def hf_reference(seqs: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from engine.loading.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32)
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
                for ids in seqs]


def tokenise(n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from engine.loading.embedded import embedded_gguf_path
    from loadgen.heldout_text import HELD_OUT

    path = embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return [tok(text)["input_ids"][:n] for text in HELD_OUT]


def top1(llm: LLM, seqs: list[list[int]]) -> list[list[int]]:
    tops = []
    for ids in seqs:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=1))[0]
        tops.append([next(t for t, lp in out.prompt_logprobs[p].items() if lp.rank == 1)
                     for p in range(1, len(ids))])
    return tops


def agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    pairs = [(a, b) for g, r in zip(got, ref) for a, b in zip(g, r)]
    return sum(a == b for a, b in pairs) / len(pairs)


def decode_time(llm: LLM, rows: int, n: int) -> float:
    """Seconds per decode step at ``rows`` sequences (prefill excluded by difference)."""
    prompts = [f"Story {i}: once upon a time" for i in range(rows)]

    def run(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start

    return (run(1 + n) - run(1)) / n


def prefill_rate(llm: LLM, n: int, seed: int) -> float:
    """Prompt tokens per second of one fresh ``n``-token prompt (random ids: no cache hit)."""
    ids = torch.randint(100, 10000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    start = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return n / (time.perf_counter() - start)


def served_activation(llm: LLM) -> str:
    """The activation precision the engine's packed linears run (after ``auto``'s choice)."""
    from engine.quantization.activation import packed_modules

    mods = packed_modules(llm.engine.runner.model)
    parts = [p for m in mods for p in getattr(m, "parts", [m])]
    return "/".join(sorted({p.kernels.activation for p in parts})) or "none (float)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill rate")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cpu-probe", default="off")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    metavar="NAME", help=f"of: {', '.join(CONFIGS)}")
    ap.add_argument("--no-timing", action="store_true", help="agreement and answer only")
    ap.add_argument("--json")
    args = ap.parse_args()
    seqs = tokenise(args.tokens)
    ref = hf_reference(seqs)
    # As served (no dtype given: float32 weights, the KV pool auto: float16 on a CPU), so the
    # default row is the default; "float32 KV" isolates the pool's share.
    llms = {name: LLM("smollm2", kv_cache_memory="256MiB", cpu_probe=args.cpu_probe,
                      **CONFIGS[name]) for name in args.configs}
    rows: dict[str, dict] = {name: {} for name in llms}
    for name, llm in llms.items():
        rows[name]["activation"] = served_activation(llm)
        rows[name]["agreement"] = agreement(top1(llm, seqs), ref)
        out = llm.chat([{"role": "user", "content": QUESTION}],
                       SamplingParams(temperature=0, max_tokens=32, logprobs=3))[0]
        rows[name]["answer"] = out.outputs[0].text
        first = out.outputs[0].logprobs[0]  # the answer's first token: a near-tie here
        tok = llm.engine.tokenizer
        rows[name]["first_token_top3"] = sorted(
            ((tok.decode([t]), round(math.exp(getattr(lp, "logprob", lp)), 4))
             for t, lp in first.items()), key=lambda kv: -kv[1])[:3]
        print(name, rows[name], flush=True)
    for rows_n in () if args.no_timing else (1, 16):
        best = dict.fromkeys(llms, float("inf"))
        for _ in range(args.reps):  # interleaved: a busy moment hits every configuration
            for name, llm in llms.items():
                best[name] = min(best[name], decode_time(llm, rows_n, args.decode))
        for name in llms:
            if rows_n == 1:
                rows[name]["tpot_1_ms"] = best[name] * 1e3
            else:
                rows[name]["tok_s_16"] = 16 / best[name]
    if not args.no_timing:
        best = dict.fromkeys(llms, 0.0)
        for rep in range(args.reps):
            for name, llm in llms.items():
                best[name] = max(best[name], prefill_rate(llm, args.prefill, rep))
        for name in llms:
            rows[name][f"prefill_{args.prefill}_tok_s"] = best[name]
    result = {"machine": machine_info(), "isa": isa(), "positions": sum(len(s) - 1 for s in seqs),
              "torch_threads": torch.get_num_threads(), "cpu_probe": args.cpu_probe,
              "configs": rows}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
