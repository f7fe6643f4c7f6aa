"""Decode throughput of the embedded model: ``tensor_parallel_size=2`` (2 gloo ranks, 1 thread
each, pinned to one core each) vs ``tensor_parallel_size=1`` (one process, all the cores as
threads), on the same machine in one run.

Each round starts an engine of each kind in turn (they cannot live side by side: a 2-rank engine
pins this process to its first core until it closes), warms it up, then times greedy decoding of
``--batch`` sizes (ignore_eos, ``--tokens`` tokens each). Decode tokens per second = tokens after
the first of every sequence / (the last token's time - the first token's time), from the
requests' own timestamps, so prefill is not counted. Both engines use the same dtype and
quantization (default float32 / none: the same arithmetic, so the same greedy tokens, which the
script checks). Prints the CPU's ISA, each figure (best of ``--rounds``) and the ratio TP2/TP1.

    PYTHONPATH=. python benchmarks/tensor_parallel.py [--tokens 64] [--batch 1 8] [--rounds 2]
        [--dtype float32] [--quantization none]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from engine import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def isa() -> str:
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return "unknown"
    for name, flag in (("AMX", "amx_tile"), ("AVX-512", "avx512f"), ("AVX2", "avx2")):
        if flag in flags:
            extra = " + AVX-512 BF16" if "avx512_bf16" in flags and name != "AVX2" else ""
            return name + extra
    return "other"


def decode_tok_s(llm: LLM, batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    prompts = [f"{PROMPT} (variant {i})" for i in range(batch)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens,
                                                ignore_eos=True))
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    return batch * (tokens - 1) / (last - first), [o.outputs[0].token_ids for o in outs]


def measure(tp: int, args) -> tuple[dict[int, float], dict[int, list], float]:
    start = time.perf_counter()
    with LLM(None, tensor_parallel_size=tp, dtype=args.dtype, quantization=args.quantization,
             kv_cache_memory="256MiB", max_model_len=1024) as llm:
        startup = time.perf_counter() - start
        decode_tok_s(llm, 2, 8)  # warm-up
        rates, tokens = {}, {}
        for b in args.batch:
            rates[b], tokens[b] = decode_tok_s(llm, b, args.tokens)
    return rates, tokens, startup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    best: dict[int, dict[int, float]] = {1: {}, 2: {}}
    startups: dict[int, float] = {}
    same = True
    for r in range(args.rounds):
        for tp in (1, 2):
            rates, tokens, startup = measure(tp, args)
            startups[tp] = startup
            for b, v in rates.items():
                best[tp][b] = max(best[tp].get(b, 0.0), v)
            if tp == 1:
                ref = tokens
            else:
                same = same and tokens == ref
            print(f"round {r + 1} TP={tp}: " + ", ".join(f"batch {b}: {v:.1f} tok/s"
                                                       for b, v in rates.items()), flush=True)
    print(f"\nembedded SmolLM2-135M, {args.dtype}, quantization {args.quantization}, "
          f"{cores} cores, {isa()}; decode tok/s, best of {args.rounds}, {args.tokens} tokens")
    print(f"{'batch':>6} {'TP=1':>10} {'TP=2':>10} {'TP2/TP1':>8}")
    for b in args.batch:
        print(f"{b:>6} {best[1][b]:>10.1f} {best[2][b]:>10.1f} {best[2][b] / best[1][b]:>8.2f}")
    print(f"start-up: TP=1 {startups[1]:.1f} s, TP=2 {startups[2]:.1f} s; greedy tokens "
          f"identical: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa(), "cores": cores, "dtype": args.dtype,
                       "quantization": args.quantization, "tokens": args.tokens,
                       "decode_tok_s": {f"tp{tp}": best[tp] for tp in (1, 2)},
                       "identical_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
