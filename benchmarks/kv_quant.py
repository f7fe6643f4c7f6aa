"""KV cache dtypes side by side on the embedded model: bytes, capacity, accuracy and decode speed.

For each ``--kv-cache-dtype`` (auto = the model's float32, float16, bfloat16, int8, int4,
fp8_e4m3 and fp8_e5m2 with ``calculate_kv_scales``, and fp8_e4m3 at scale 1.0; ``--variants``
picks some, ``auto`` always first), in one process, with the weights exact
(``quantization="none"``) so that only the KV cache differs:

* bytes per token (scales included), KV blocks in a fixed ``--kv-memory``, and the maximum
  concurrency at ``--max-model-len`` that follows;
* accuracy against ``auto``: teacher-forced top-1 agreement and perplexity on a fixed text,
  prefilled in chunks of 16 tokens so that every chunk after the first attends over the cache
  as decode does (a whole prompt attends over its own exact K/V, as in vLLM);
* decode speed on a KV-bound step: ``--batch`` sequences at each context length in
  ``--contexts`` decoding together, prompts prefilled first; the median time of a pure decode
  step (= TPOT of each sequence).

Prints a table, writes ``--json`` and, with ``--plot``, a PNG of bytes per token and maximum
concurrency per dtype.

    PYTHONPATH=. python benchmarks/kv_quant.py [--contexts 512 2048] [--batch 8] [--variants ...]
        [--json docs/perf/DATE_MACHINE_kv-quant.json] [--plot docs/perf/DATE_MACHINE_kv-quant.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time

from tqdm import tqdm

from engine import LLM, SamplingParams
from loadgen.teacher_forced import TEXT, forced, perplexity_of

VARIANTS = [  # (label, kv_cache_dtype, calculate_kv_scales)
    ("auto", "auto", False),
    ("float16", "float16", False),
    ("bfloat16", "bfloat16", False),
    ("int8", "int8", False),
    ("int4", "int4", False),
    ("fp8_e4m3", "fp8_e4m3", True),
    ("fp8_e5m2", "fp8_e5m2", True),
    ("fp8_e4m3 scale 1", "fp8_e4m3", False),
]


def isa() -> str:
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.machine()
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else platform.machine()


def decode_step_ms(llm: LLM, batch: int, context: int, steps: int, vocab: int) -> float:
    """Median time of a pure decode step of ``batch`` sequences at ``context`` tokens: the
    prompts are prefilled first (those steps are not timed), then ``steps`` steps timed."""
    rng = random.Random(context)
    core = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"b{context}-{i}", [rng.randrange(100, vocab) for _ in range(context)],
                         params)
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in core.step() if o.outputs[0].token_ids}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    while core.has_unfinished_requests():
        core.step()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-memory", default="512MiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 2048])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24, help="decode steps timed per context")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--variants", nargs="*", default=None,
                    help="labels to run (default: all): " + ", ".join(v[0] for v in VARIANTS))
    args = ap.parse_args()
    variants = [v for v in VARIANTS if args.variants is None or v[0] == "auto"
                or v[0] in args.variants]

    results: dict[str, dict] = {}
    reference = None
    for label, kind, calibrate in tqdm(variants, desc="KV dtypes"):
        llm = LLM(None, dtype="float32", quantization="none", kv_cache_memory=args.kv_memory,
                  max_model_len=args.max_model_len, max_num_batched_tokens=16,
                  kv_cache_dtype=kind, calculate_kv_scales=calibrate)
        runner = llm.engine.runner
        ids = llm.tokenizer.encode(TEXT)
        ranked = forced(llm, ids)
        ppl = perplexity_of(ranked)
        r = {"kv_cache_dtype": kind, "calculate_kv_scales": calibrate,
             "bytes_per_token": runner.kv_bytes_per_token, "num_blocks": runner.num_blocks,
             "max_concurrency": runner.num_blocks * llm.engine.config.block_size
             / args.max_model_len, "perplexity": ppl}
        if reference is None:
            reference = (ranked, ppl)
        ref_top1 = [rank == 1 for rank, _ in reference[0]]
        agree = [(rank == 1) == want for (rank, _), want in zip(ranked, ref_top1)]
        r["top1_agreement"] = sum(agree) / len(agree)
        r["perplexity_delta"] = ppl / reference[1] - 1
        # Decode speed: a separate engine with whole-prompt prefill (the timed part is decode).
        fast = LLM(None, dtype="float32", quantization="none", kv_cache_memory=args.kv_memory,
                   max_model_len=args.max_model_len, kv_cache_dtype=kind,
                   calculate_kv_scales=calibrate)
        decode_step_ms(fast, 2, 32, 4, runner.arch.vocab_size)  # warm-up
        r["tpot_ms"] = {str(c): decode_step_ms(fast, args.batch, c, args.tokens,
                                               runner.arch.vocab_size) for c in args.contexts}
        results[label] = r
        del llm, fast

    base = results["auto"]
    print(f"\nKV cache dtypes, embedded model (SmolLM2-135M, 30 layers x 3 KV heads x 64), "
          f"float32 weights, {isa()}, {args.kv_memory} of KV")
    cols = " | ".join(f"step @{c} (ms)" for c in args.contexts)
    print(f"| kv_cache_dtype | bytes/token | vs auto | blocks | max concurrency @"
          f"{args.max_model_len} | top-1 agreement | perplexity (delta) | {cols} |")
    print("|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(args.contexts))
    for label, r in results.items():
        tp = " | ".join(f"{r['tpot_ms'][str(c)]:.1f} ({base['tpot_ms'][str(c)] / r['tpot_ms'][str(c)]:.2f}x)"
                        for c in args.contexts)
        print(f"| {label} | {r['bytes_per_token']:,} | {r['bytes_per_token'] / base['bytes_per_token']:.3f} "
              f"| {r['num_blocks']:,} | {r['max_concurrency']:.1f} | {r['top1_agreement']:.1%} "
              f"| {r['perplexity']:.3f} ({r['perplexity_delta']:+.2%}) | {tp} |")
    meta = {"isa": isa(), "batch": args.batch, "kv_memory": args.kv_memory,
            "max_model_len": args.max_model_len, "text_tokens": len(reference[0]) + 1}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    if args.plot:
        plot(results, args.plot, meta)


def plot(results: dict[str, dict], path: str, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(labels, [results[k]["bytes_per_token"] / 1024 for k in labels], color="#4878a8")
    a.set_ylabel("KiB per token (K+V, scales included)")
    a.set_title("KV bytes per token")
    b.bar(labels, [results[k]["max_concurrency"] for k in labels], color="#6aa84f")
    b.set_ylabel(f"sequences of {meta['max_model_len']} tokens")
    b.set_title(f"max concurrency in {meta['kv_memory']}")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"SmolLM2-135M KV cache per dtype ({meta['isa']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
