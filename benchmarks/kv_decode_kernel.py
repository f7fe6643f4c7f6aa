"""The CPU paged-decode kernel over float32, float16, bfloat16, int8 and fp8 pools, side by side.

``--batch`` sequences of ``--context`` keys, the embedded model's attention shape (9 heads,
3 KV heads, head_dim 64), block size 16, shuffled block tables. ``--layers`` pools are cycled
so the K/V come from memory, as in a real step (one layer's pool would sit in the L3 cache).
Prints the median time per layer call and the ratio to float32.

    PYTHONPATH=. python benchmarks/kv_decode_kernel.py [--batch 8] [--context 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.cpu.kernels import load
from engine.kv_storage.formats import byte_view, fp8_table, kv_format, quantize_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    kernels = load()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build")
    b, h, kvh, d, bs, ctx = args.batch, 9, 3, 64, 16, args.context
    nb = b * -(-ctx // bs) + 8
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(nb, bs, kvh, d, generator=g), torch.randn(nb, bs, kvh, d, generator=g))
             for _ in range(args.layers)]
    q = torch.randn(b, h, d, generator=g)
    tables = torch.randperm(nb, generator=g)[:b * -(-ctx // bs)].view(b, -1).to(torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    i8, f8 = kv_format("int8", torch.float32, d), kv_format("fp8_e4m3", torch.float32, d)
    int8 = [(quantize_rows(k, i8), quantize_rows(v, i8)) for k, v in pools]
    fp8 = [(byte_view(quantize_rows(k, f8)), byte_view(quantize_rows(v, f8))) for k, v in pools]
    one, lut = torch.ones(kvh), fp8_table(f8.storage_dtype)
    half = {dt: [(k.to(dt), v.to(dt)) for k, v in pools] for dt in (torch.float16, torch.bfloat16)}
    runs = {
        "float32": lambda: [kernels.paged_decode_cpu(q, k, v, tables, lens, 0.125, 0)
                            for k, v in pools],
        "float16": lambda: [kernels.paged_decode_cpu(q, k, v, tables, lens, 0.125, 0)
                            for k, v in half[torch.float16]],
        "bfloat16": lambda: [kernels.paged_decode_cpu(q, k, v, tables, lens, 0.125, 0)
                             for k, v in half[torch.bfloat16]],
        "int8": lambda: [kernels.paged_decode_cpu_int8(q, k, v, tables, lens, 0.125, 0)
                         for k, v in int8],
        "fp8_e4m3": lambda: [kernels.paged_decode_cpu_fp8(q, k, v, tables, lens, 0.125, 0, lut,
                                                          one, one) for k, v in fp8],
    }
    times = {}
    for name, fn in runs.items():
        fn()
        samples = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) / args.layers)
        times[name] = statistics.median(samples)
    print(f"paged decode, {b} sequences x {ctx} keys, 9/3 heads x 64, torch threads "
          f"{torch.get_num_threads()}:")
    for name, t in times.items():
        print(f"  {name:9s} {t * 1e3:7.3f} ms per layer   {times['float32'] / t:5.2f}x float32")


if __name__ == "__main__":
    main()
