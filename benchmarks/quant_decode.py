"""Single-stream decode of the embedded model: ``quantization="auto"`` vs ``"none"``.

Both engines live in one process and run alternately (``--rounds`` times each, best and median
kept), one prompt, ``--tokens`` greedy tokens (ignore_eos). TPOT = (last token - first token) /
(tokens - 1), from the request's own timestamps. ``--batch B`` also times B prompts decoded
together (output tokens per second of the whole ``generate`` call), the batched decode that a
quantised path must not slow down. Prints whether ``auto`` actually kept the
packed weights (its start-up probe may choose float on a machine where that is faster), the
resident weight bytes of each, and the ratio.

    PYTHONPATH=. python benchmarks/quant_decode.py [--tokens 128] [--rounds 3] [--force]
        [--threads N]

On a machine shared with other busy processes, OpenMP's barriers can stall every step of
both engines for a scheduler time slice (seen: ~1 s per token on 2 threads with a third busy
process); ``--threads 1`` avoids that, and the start-up probe's verdict is a coin toss then.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from engine import LLM, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def tpot_ms(llm: LLM, tokens: int) -> float:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=tokens,
                                                ignore_eos=True))[0]
    m = out.metrics
    return (m.last_token_time - m.first_token_time) / (tokens - 1) * 1e3


def batch_tok_s(llm: LLM, batch: int, tokens: int) -> float:
    prompts = [f"{PROMPT} (variant {i})" for i in range(batch)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return batch * tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--force", action="store_true", help="KVSERVE_QUANT_FORCE=1 for auto")
    ap.add_argument("--threads", type=int, default=None, help="num_threads of both engines")
    ap.add_argument("--batch", type=int, default=0, help="also time this many prompts at once")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    common = dict(dtype="float32", kv_cache_memory="256MiB", num_threads=args.threads)
    engines = {"none": LLM(None, quantization="none", **common)}
    if args.force:
        os.environ["KVSERVE_QUANT_FORCE"] = "1"
    engines["auto"] = LLM(None, quantization="auto", **common)
    for llm in engines.values():
        tpot_ms(llm, 8)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in engines}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            times[name].append(tpot_ms(llm, args.tokens))
            if args.batch:
                rates[name].append(batch_tok_s(llm, args.batch, args.tokens // 2))
    result = {}
    for name, llm in engines.items():
        runner = llm.engine.runner
        result[name] = {"tpot_ms_best": min(times[name]),
                        "tpot_ms_median": statistics.median(times[name]),
                        "packed": runner.quantized, "weight_bytes": runner.weight_bytes}
        print(f"{name:5s} packed={runner.quantized!s:5s} weights {runner.weight_bytes / 2**20:7.1f} "
              f"MiB  TPOT best {min(times[name]):6.2f} ms  median "
              f"{statistics.median(times[name]):6.2f} ms  (rounds: "
              f"{', '.join(f'{t:.2f}' for t in times[name])})")
        if args.batch:
            result[name]["batch_tok_s_median"] = statistics.median(rates[name])
            print(f"      batch of {args.batch}: {statistics.median(rates[name]):7.1f} out tok/s "
                  f"(median; rounds {', '.join(f'{r:.1f}' for r in rates[name])})")
    print(f"none/auto TPOT ratio (median): "
          f"{result['none']['tpot_ms_median'] / result['auto']['tpot_ms_median']:.2f}")
    if args.batch:
        print(f"auto/none batch-of-{args.batch} throughput ratio (median): "
              f"{result['auto']['batch_tok_s_median'] / result['none']['batch_tok_s_median']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
