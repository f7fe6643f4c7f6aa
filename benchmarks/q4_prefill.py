"""A 4-bit linear's prefill path: dequantised float32 panels vs int8 tiles, same run.

For each 4-bit layer shape of SmolLM2-135M (fused QKV, O, fused gate/up, down; Q4_1-style
weights) and each row count, times ``QuantLinear`` with ``q4_prefill="panels"`` (dequantise,
then a float32 matmul: what served prefill before) and ``q4_prefill="int8"``
(``quant_gemm_q4_tiled``), alternated, best of ``--reps``; prints milliseconds, GMAC/s and the
ratio (> 1: int8 tiles faster), after the CPU's ISA flags and any ISA caps in the environment
(``KVSERVE_CPU_MARCH``, ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``; set all four to run the AVX2 paths on an AVX-512 machine, as
``benchmarks/vs_llamacpp.sh --avx2`` does).

    PYTHONPATH=. python benchmarks/q4_prefill.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from tqdm import tqdm

from engine.models.quant_linear import QuantLinear
from engine.models.quant_probe_cache import ISA_CAPS
from engine.models.quant_rtn import quantise

SHAPES = [(960, 576, "qkv_proj"), (576, 576, "o_proj"), (3072, 576, "gate_up_proj"),
          (576, 1536, "down_proj")]
ROWS = [64, 256, 2048]


def isa() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))))


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    caps = {v: os.environ[v] for v in ISA_CAPS if v in os.environ}
    print(f"ISA: {isa()}\ncaps: {caps or 'none'}\nthreads: {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    results = []
    for n, k, name in tqdm([(n, k, s) for n, k, s in SHAPES], desc="shapes"):
        lin = QuantLinear(quantise(torch.randn(n, k, generator=g) * 0.05, "int4", 32))
        for rows in ROWS:
            x = torch.randn(rows, k, generator=g)
            t = {}
            for _ in range(2):  # alternate the two paths twice: a busy moment hits both
                for path in ("panels", "int8"):
                    lin.set_q4_prefill(path)
                    t[path] = min(t.get(path, float("inf")), best(lambda lin=lin, x=x: lin(x), args.reps))
            macs = rows * n * k
            results.append({"shape": name, "out": n, "in": k, "rows": rows,
                            "panels_ms": t["panels"] * 1e3, "int8_ms": t["int8"] * 1e3,
                            "ratio": t["panels"] / t["int8"]})
            tqdm.write(f"{name:>12} {n}x{k} rows {rows:5}: panels {t['panels'] * 1e3:8.2f} ms "
                       f"({macs / t['panels'] / 1e9:4.0f} GMAC/s)  int8 {t['int8'] * 1e3:8.2f} ms "
                       f"({macs / t['int8'] / 1e9:4.0f} GMAC/s)  int8 {t['panels'] / t['int8']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa(), "caps": caps, "threads": torch.get_num_threads(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
