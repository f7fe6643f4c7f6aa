"""4-bit weights in the rows layout against the blocked layout, same run, alternated.

Two parts:

* kernels: one pass over SmolLM2-135M's 120 4-bit projections (30 layers of fused QKV, O,
  fused gate/up, down; Q4_1-style weights, every layer its own weight so that a pass reads
  them from memory as a decode step does) at 1, 2, 3 and 16 rows, with the rows layout's
  decode kernel (``quant_gemm_q4``), its repacking tiles (``quant_gemm_q4_tiled``) and the
  blocked kernel (``quant_gemm_q4_blocked``); the median of ``--reps`` passes, best of two
  alternations;
* engine (``--engine``): the embedded model in one process, every 4-bit module switched
  between the layouts (the C++ decode stack rebuilt each time), alternated ``--rounds`` times:
  a single stream of 128 greedy tokens (TPOT from the request's timestamps) and 16 prompts x 64
  tokens together (output tokens per second of the whole call, prefill included).

Prints the CPU's ISA flags and any ISA caps in the environment (``KVSERVE_CPU_MARCH``,
``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``; set all four to run
the AVX2 paths on an AVX-512 machine, as ``benchmarks/vs_llamacpp.sh --avx2`` does).

    PYTHONPATH=. python benchmarks/q4_layout.py [--engine] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch
from q4_tiles import isa, timed_runs  # a sibling script (run as benchmarks/q4_layout.py)
from tqdm import tqdm

from engine.quantization.blocked import to_blocked
from engine.quantization.linear import quant_kernels
from engine.quantization.probe_cache import ISA_CAPS
from engine.quantization.rtn import quantise

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
ROWS = [1, 2, 3, 16]


def median_pass(fn, reps: int) -> float:
    return statistics.median(timed_runs(fn, reps))


def kernels_part(reps: int) -> list[dict]:
    k = quant_kernels()
    g = torch.Generator().manual_seed(0)
    weights = [[quantise(torch.randn(n, kk, generator=g) * 0.05, "int4", 32) for n, kk in SHAPES]
               for _ in tqdm(range(LAYERS), desc="weights")]
    blocked = [[to_blocked(p.qs, p.d, p.m) for p in layer] for layer in weights]
    results = []
    for rows in tqdm(ROWS, desc="rows"):
        xs = {kk: torch.randn(rows, kk, generator=g) for kk in (576, 1536)}

        def over_rows(kernel, xs=xs):
            return lambda: [kernel(xs[kk], p.qs, p.d, p.m)
                            for layer in weights for (_, kk), p in zip(SHAPES, layer)]

        def over_blocked(xs=xs):
            for layer in blocked:
                for (n, kk), (q, d, m) in zip(SHAPES, layer):
                    k.quant_gemm_q4_blocked(xs[kk], q, d, m, n)

        paths = {"decode kernel": over_rows(k.quant_gemm_q4),
                 "tiles (repacked per call)": over_rows(k.quant_gemm_q4_tiled),
                 "blocked": over_blocked}
        t: dict[str, float] = {}
        for _ in range(2):  # alternate: a busy moment hits every path
            for name, fn in paths.items():
                t[name] = min(t.get(name, float("inf")), median_pass(fn, reps))
        best_rows = min(t["decode kernel"], t["tiles (repacked per call)"])
        results.append({"rows": rows, **{f"{n}_ms": v * 1e3 for n, v in t.items()},
                        "blocked_vs_best_rows_layout": best_rows / t["blocked"]})
        tqdm.write(f"{rows:3d} rows: " + "  ".join(f"{n} {v * 1e3:.3f} ms" for n, v in t.items())
                   + f"  -> blocked {best_rows / t['blocked']:.2f}x the rows layout's best")
    return results


def engine_part(rounds: int) -> dict:
    from engine import LLM, SamplingParams
    from engine.models.cpu_decode_stack import build_decode_stack
    from engine.quantization.linear import QuantLinear

    llm = LLM(None, kv_cache_dtype="float16", kv_cache_memory="1GiB", max_num_seqs=16)
    model = llm.engine.runner.model
    mods = [m for m in model.modules() if isinstance(m, QuantLinear) and m.is_q4]
    chosen = {m.q4_layout for m in mods}

    def use(layout: str) -> None:
        for m in mods:
            m.set_q4_layout(layout)
        model.decode_stack, _ = build_decode_stack(model)

    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4
    one = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    batch = [prompt + str(i) for i in range(16)]
    gc.collect()
    gc.freeze()
    out: dict[str, dict[str, list[float]]] = {}
    for _ in tqdm(range(rounds), desc="engine rounds"):
        for layout in ("rows", "blocked"):
            use(layout)
            m = llm.generate([prompt], one)[0].metrics
            tpot = (m.last_token_time - m.first_token_time) / (one.max_tokens - 1) * 1e3
            start = time.perf_counter()
            outs = llm.generate(batch, many)
            tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
            r = out.setdefault(layout, {"tpot_ms": [], "batch16_tok_s": []})
            r["tpot_ms"].append(tpot)
            r["batch16_tok_s"].append(tps)
    for layout, r in out.items():
        print(f"{layout:8s} single stream TPOT {', '.join(f'{v:.2f}' for v in r['tpot_ms'])} ms;"
              f" 16 x 64 tokens {', '.join(f'{v:.0f}' for v in r['batch16_tok_s'])} tok/s")
    return {"probe_chose": sorted(chosen), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--engine", action="store_true", help="also the engine A/B (loads the model)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    caps = {v: os.environ[v] for v in ISA_CAPS if v in os.environ}
    print(f"ISA: {isa()}\ncaps: {caps or 'none'}\nthreads: {torch.get_num_threads()}")
    report = {"isa": isa(), "caps": caps, "threads": torch.get_num_threads(),
              "kernels": kernels_part(args.reps)}
    if args.engine:
        report["engine"] = engine_part(args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
