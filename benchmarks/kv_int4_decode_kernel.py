"""The CPU paged-decode kernel over an int4 pool vs a float16 pool, side by side.

One decode step of attention (one query token per sequence) at ``--context`` tokens per
sequence, SmolLM2's shape by default (9 query heads, 3 KV heads, head_dim 64), block size 16,
block tables shuffled as a long-running pool's are, each call reading the next of ``--layers``
pools of its dtype, so that rows are not in a warm cache (one pool per layer, as in a real step). Times
``paged_decode_cpu`` over float16 rows and ``paged_decode_cpu_int4``: the kernel alone; with
the query rotated in and the output back by the C++ rotation (as the C++ decode stack does);
and by ``formats.int4_rotate`` (as the torch backend does). Runs are interleaved, the median of
``--reps`` kept. Prints microseconds per call and each int4 figure / float16.

    PYTHONPATH=. python benchmarks/kv_int4_decode_kernel.py [--context 2048] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import envs
from engine.cpu.kernels import load
from engine.kv_storage.formats import int4_rotate, kv_format, quantize_rows


def _pools(batch: int, context: int, kv_heads: int, head_dim: int, block_size: int,
           layers: int):
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    fmt = kv_format("int4", torch.float32, head_dim)
    lens = torch.full((batch,), context, dtype=torch.int32)
    f16 = [(k.half(), v.half())]
    int4 = [(quantize_rows(k, fmt), quantize_rows(v, fmt))]
    f16 += [(a.clone(), b.clone()) for a, b in f16 * (layers - 1)]
    int4 += [(a.clone(), b.clone()) for a, b in int4 * (layers - 1)]
    return tables, lens, f16, int4


NAMES = ["float16", "int4", "int4+rot C++", "int4+rot torch"]


def time_batch(kernels, args, batch: int) -> dict[str, float]:
    """Median microseconds per call of each of ``NAMES`` at ``batch`` sequences."""
    tables, lens, f16, int4 = _pools(batch, args.context, args.kv_heads, args.head_dim, 16,
                                     args.layers)
    q = torch.randn(batch, args.heads, args.head_dim)
    scale = args.head_dim ** -0.5

    def run(name: str, layer: int) -> None:
        if name == "float16":
            kernels.paged_decode_cpu(q, *f16[layer], tables, lens, scale, 0)
            return
        if name == "int4":
            kernels.paged_decode_cpu_int4(q, *int4[layer], tables, lens, scale, 0)
            return
        rot = kernels.int4_rotate_cpu if name == "int4+rot C++" else int4_rotate
        rot(kernels.paged_decode_cpu_int4(rot(q), *int4[layer], tables, lens, scale, 0))

    times: dict[str, list[float]] = {name: [] for name in NAMES}
    calls = {"float16": 0, "int4": 0}  # each call reads the next pool of its dtype
    for rep in range(args.reps + 10):  # the first 10: warm-up
        for name in NAMES:
            dtype = "float16" if name == "float16" else "int4"
            layer = calls[dtype] % args.layers
            calls[dtype] += 1
            t0 = time.perf_counter()
            run(name, layer)
            if rep >= 10:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="pools cycled (SmolLM2-135M: 30)")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    kernels = load()
    assert kernels is not None, "CPU kernels unavailable"
    print(f"context {args.context}, heads {args.heads}/{args.kv_heads}, head_dim "
          f"{args.head_dim}, {args.layers} pools cycled, threads {torch.get_num_threads()}, "
          f"kernels built for -march={envs.cpu_march()}")
    print("batch " + " ".join(f"{n + ' us':>17}" for n in NAMES)
          + "   int4 / float16 (kernel, +rot C++, +rot torch)")
    for b in args.batch:
        us = time_batch(kernels, args, b)
        ratios = " ".join(f"{us[n] / us['float16']:.2f}" for n in NAMES[1:])
        print(f"{b:>5} " + " ".join(f"{us[n]:>17.1f}" for n in NAMES) + f"   {ratios}")


if __name__ == "__main__":
    main()
