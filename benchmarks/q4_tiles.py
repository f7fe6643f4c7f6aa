"""The int8 tiles of a 4-bit linear against what they replace, same run.

For each 4-bit layer shape of SmolLM2-135M (fused QKV, O, fused gate/up, down; Q4_1-style
weights), times ``QuantLinear`` both ways, alternated, best of ``--reps``:

* decode batches (1, 3, 16 rows): the decode kernel (``q4_batch="kernel"``) against the tiles
  (``"tiles"``; at 1 row the module keeps the kernel, so the tiled kernel is called directly);
* prefill (64, 256, 2048 rows): dequantised float32 panels (``q4_prefill="panels"``) against
  the tiles (``"int8"``).

Prints milliseconds, GMAC/s and the ratio (> 1: tiles faster), after the CPU's ISA flags and any
ISA caps in the environment (``KVSERVE_CPU_MARCH``, ``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``; set all four to run the AVX2 paths on an
AVX-512 machine, as ``benchmarks/vs_llamacpp.sh --avx2`` does).

    PYTHONPATH=. python benchmarks/q4_tiles.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from tqdm import tqdm

from engine.quantization.linear import QuantLinear, quant_kernels
from engine.quantization.probe_cache import ISA_CAPS
from engine.quantization.rtn import quantise

SHAPES = [(960, 576, "qkv_proj"), (576, 576, "o_proj"), (3072, 576, "gate_up_proj"),
          (576, 1536, "down_proj")]
BATCH_ROWS = [1, 3, 16]
PREFILL_ROWS = [64, 256, 2048]


def isa() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return " ".join(sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))))


def timed_runs(fn, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best(fn, reps: int) -> float:
    return min(timed_runs(fn, reps))


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
    tiled = quant_kernels().quant_gemm_q4_tiled
    for n, k, name in tqdm(SHAPES, desc="shapes"):
        lin = QuantLinear(quantise(torch.randn(n, k, generator=g) * 0.05, "int4", 32))
        for rows in BATCH_ROWS + PREFILL_ROWS:
            x = torch.randn(rows, k, generator=g)
            if rows in BATCH_ROWS:
                setting, sides = lin.set_q4_batch, ("kernel", "tiles")
            else:
                setting, sides = lin.set_q4_prefill, ("panels", "int8")
            t = {}
            for _ in range(2):  # alternate the two paths twice: a busy moment hits both
                for side in sides:
                    setting(side)
                    if rows == 1 and side == "tiles":  # below BATCH_TILE_ROWS: call it directly
                        run = lambda lin=lin, x=x, f=tiled: f(x, lin.qs, lin.d, lin.m)  # noqa: E731
                    else:
                        run = lambda lin=lin, x=x: lin(x)  # noqa: E731
                    t[side] = min(t.get(side, float("inf")), best(run, args.reps))
            old_s, new_s = t[sides[0]], t[sides[1]]
            macs = rows * n * k
            results.append({"shape": name, "out": n, "in": k, "rows": rows, "baseline": sides[0],
                            "baseline_ms": old_s * 1e3, "tiles_ms": new_s * 1e3,
                            "ratio": old_s / new_s})
            tqdm.write(f"{name:>12} {n}x{k} rows {rows:5}: {sides[0]:>6} {old_s * 1e3:8.3f} ms "
                       f"({macs / old_s / 1e9:4.0f} GMAC/s)  tiles {new_s * 1e3:8.3f} ms "
                       f"({macs / new_s / 1e9:4.0f} GMAC/s)  tiles {old_s / new_s:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa(), "caps": caps, "threads": torch.get_num_threads(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
