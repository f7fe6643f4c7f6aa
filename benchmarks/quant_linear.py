"""Quantised linears vs the float32 packed linear, at the embedded model's shapes.

For each weight shape (out x in) of SmolLM2-135M and each row count, times the float32
``PackedLinear`` (the engine's default CPU backend) and ``QuantLinear`` over the same weight in
4-bit (Q4_1-style) and, for the embedding/logits shape, 8-bit (Q8_0) groups (and the K-quants
Q4_K / Q5_K / Q6_K, with Q8_0 beside them, at the one shape whose rows hold 256), and prints
microseconds and the float/quant ratio (> 1: quantised faster). For the 4-bit shapes it also
times the alternative kernel design, ``quant_gemm_q4_fma`` (nibbles unpacked to floats in
registers, float FMA with unquantised activations), at rows <= ``DENSE_ROWS``. Weights are cycled through
``--copies`` independent instances so that they come from memory, as in a decode step, not
from cache. Prints the CPU's ISA flags first.

    PYTHONPATH=. python benchmarks/quant_linear.py [--threads 2] [--json out.json]
        [--formats Q4_K,Q5_K,Q6_K,Q8_0]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from engine.quantization.gguf_blocks import from_gguf_blocks
from engine.quantization.linear import DENSE_ROWS, QuantLinear, quant_kernels
from engine.quantization.packed_linear import PackedLinear, linear_backend

SHAPES = [(576, 576, "Q4_1"), (192, 576, "Q4_1"), (1536, 576, "Q4_1"), (576, 1536, "Q4_1"),
          (49152, 576, "Q8_0"),
          # K-quants need rows of 256: SmolLM2's down_proj shape, with Q8_0 as the 8-bit baseline.
          (576, 1536, "Q4_K"), (576, 1536, "Q5_K"), (576, 1536, "Q6_K"), (576, 1536, "Q8_0")]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
ROWS = [1, 4, 16, 64, 256]


def isa() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.machine()
    keep = [f for f in flags if f.startswith(("avx", "fma", "amx")) or f in ("f16c",)]
    return " ".join(sorted(keep))


def gguf_blocks(w: np.ndarray, qtype) -> np.ndarray:
    """GGUF blocks for ``w``: gguf's quantiser, or for the K-quants (which it cannot quantise)
    random valid blocks with small fp16 scales (the kernels' speed does not depend on values)."""
    if qtype.name not in K_QUANTS:
        return quants.quantize(w, qtype)
    n, k = w.shape
    per, nbytes = quants.GGML_QUANT_SIZES[qtype]
    raw = np.random.randint(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for off in ((208,) if qtype.name == "Q6_K" else (0, 2)):
        scale = np.full((n, k // per), 1e-3, np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def bench(fn, xs, reps: int) -> float:
    for x in xs[:2]:
        fn[0](x)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for f, x in zip(fn, xs):
            f(x)
        best = min(best, (time.perf_counter() - start) / len(fn))
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copies", type=int, default=8, help="weight instances cycled per timing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--formats", default=None, help="comma-separated GGUF types to run (all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kern = quant_kernels()
    backend = linear_backend(torch.device("cpu"), torch.float32)
    print(f"ISA flags: {isa()}\nquant kernel ISA: {kern.quant_gemm_isa()}  float backend: "
          f"{backend}  threads: {torch.get_num_threads()}")
    rows_out = []
    torch.manual_seed(0)
    wanted = set(args.formats.split(",")) if args.formats else None
    for n, k, qname in SHAPES:
        if wanted is not None and qname not in wanted:
            continue
        qtype = GGMLQuantizationType[qname]
        copies = max(1, args.copies if n * k < 5e6 else 2)
        floats, quant, fma = [], [], []
        for _ in range(copies):
            w = np.random.randn(n, k).astype(np.float32) * 0.02
            raw = gguf_blocks(w, qtype)
            packed = from_gguf_blocks(raw, int(qtype), (n, k))
            floats.append(PackedLinear(torch.from_numpy(quants.dequantize(raw, qtype)), None,
                                       backend))
            quant.append(QuantLinear(packed))
            if qname.startswith("Q4"):
                fma.append(lambda x, p=packed: kern.quant_gemm_q4_fma(x, p.qs, p.d, p.m))
        for m in ROWS:
            xs = [torch.randn(m, k) for _ in range(copies)]
            with torch.inference_mode():
                tf = bench(floats, xs, args.reps)
                tq = bench(quant, xs, args.reps)
                tv = bench(fma, xs, args.reps) if fma and m <= DENSE_ROWS else None
            rows_out.append({"out": n, "in": k, "format": qname, "rows": m, "float_us": tf,
                             "quant_us": tq, "ratio": tf / tq, "q4_fma_us": tv})
            alt = f"  (q4 float-FMA variant {tv:8.1f} us)" if tv is not None else ""
            print(f"{n:6d}x{k:<5d} {qname} M={m:4d}  float32 {tf:9.1f} us  quant {tq:9.1f} us  "
                  f"float/quant {tf / tq:5.2f}{alt}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": isa(), "threads": torch.get_num_threads(), "rows": rows_out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
