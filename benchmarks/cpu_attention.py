"""The compiled CPU paged-attention kernel (engine/cpu/csrc/paged_decode_vec.h) on serving shapes,
with its K/V read from memory, not cache; optionally next to another commit's kernel.

    python benchmarks/cpu_attention.py                       # this checkout
    python benchmarks/cpu_attention.py --against HEAD~1      # and HEAD~1's, runs alternated

Shapes (``--shape gemma3``: 4 query heads and 1 KV head of 256, 18 layers; ``smollm2``: 9 and 3
of 64, 30 layers), a float16 pool (``--kv-dtype``: or bfloat16, float32, and int8 or int4 rows
through their kernels) in 2 MiB pages as the engine maps it, shuffled
block tables of 16 tokens, one pool per layer so that a step's reads come from DRAM:

* ``decode 16 x 310`` / ``16 x 1500`` / ``1 x 2000``: one query row for each of 16 sequences
  (one sequence: a single stream);
* ``prompt 4 x 280`` / ``1 x 1480``: every row of 4 prompts of 280 tokens (one of 1,480), each
  row over keys 0 .. its position, as batch-invariant serving computes a prompt's attention.

Each case reports the median time per layer over repeats, multiply-adds per second and K/V
bytes per second (each key's K and V row counted once). With ``--against REV`` that commit is
checked out into a worktree (as benchmarks/commit_ab.py does), the same cases run there and here
in alternating fresh processes (``--rounds``), and the ratio of the medians is printed per case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"gemma3": (4, 1, 256, 18), "smollm2": (9, 3, 64, 30)}  # heads, kv heads, dim, layers
CASES = {  # name: (rows' key counts, rows' sequence index or None for one sequence per row)
    "decode 16 x 310": ([310] * 16, None),
    "decode 16 x 1500": ([1500] * 16, None),
    "decode 1 x 2000": ([2000], None),
    "prompt 4 x 280": ([j + 1 for _ in range(4) for j in range(280)],
                       [s for s in range(4) for _ in range(280)]),
    "prompt 1 x 1480": ([j + 1 for j in range(1480)], [0] * 1480),
}

MEASURE = r'''
import json, sys, time
sys.path.insert(0, ".")
import torch
from engine.cpu.kernels import load
from engine.kv_format.formats import kv_format, quantize_rows
from engine.runner.cpu_pool import zeroed_pool as _zeros

opts = json.loads(sys.argv[1])
heads, kv_heads, dim, layers = opts["shape"]
fmt = kv_format(opts["kv_dtype"], torch.float32, dim)
kernel = load()
attend = {"float": kernel.paged_decode_cpu, "int8": kernel.paged_decode_cpu_int8,
          "int4": kernel.paged_decode_cpu_int4}[fmt.kind]
torch.manual_seed(0)
bs, results = 16, {}
for name, (lens, seqs) in opts["cases"].items():
    nseq = len(lens) if seqs is None else max(seqs) + 1
    mb = -(-max(lens) // bs)
    nblocks = nseq * mb + 1
    pools = []
    for _ in range(layers):  # the engine's mapping: 2 MiB pages where the kernel allows them
        kv = [_zeros((nblocks, bs, kv_heads, fmt.row_width), fmt.storage_dtype,
                     torch.device("cpu")) for _ in "kv"]
        for p in kv:
            p.copy_(quantize_rows(torch.randn(nblocks, bs, kv_heads, dim), fmt))
        pools.append(kv)
    tables = torch.randperm(nblocks)[: nseq * mb].view(nseq, mb).to(torch.int32)
    if seqs is not None:
        tables = tables[torch.tensor(seqs)].contiguous()
    q = torch.randn(len(lens), heads, dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def step():
        for k, v in pools:
            attend(q, k, v, tables, seq_lens, dim ** -0.5, 0)

    step()
    times = []
    for _ in range(opts["repeats"]):
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) / layers)
    results[name] = sorted(times)[len(times) // 2]
    del pools
print("RESULT " + json.dumps(results))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3")
    ap.add_argument("--kv-dtype", default="float16",
                    choices=["float16", "bfloat16", "float32", "int8", "int4"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--against", default=None, help="a commit to run side by side")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    heads, kv_heads, dim, layers = SHAPES[args.shape]
    opts = {"shape": SHAPES[args.shape], "kv_dtype": args.kv_dtype, "repeats": args.repeats,
            "cases": CASES}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from commit_ab import here_and_against

    runs = here_and_against(MEASURE, opts, args.against, args.rounds)
    sides = list(runs)
    sys.path.insert(0, str(ROOT))
    import torch

    from engine.kv_format.formats import kv_format

    row_bytes = kv_format(args.kv_dtype, torch.float32, dim).row_bytes
    print(f"{args.shape}: {heads} heads, {kv_heads} KV heads of {dim}, {layers} layers, "
          f"{args.kv_dtype} pool; median ms per layer")
    for case, (lens, _) in CASES.items():
        keys = sum(lens)
        macs = keys * heads * dim * 2
        kv_bytes = keys * kv_heads * row_bytes * 2
        cells = []
        med = {}
        for name in sides:
            med[name] = statistics.median(r[case] for r in runs[name])
            cells.append(f"{name} {med[name] * 1e3:7.3f} ms ({macs / med[name] / 1e9:5.1f} GMAC/s, "
                         f"{kv_bytes / med[name] / 1e9:5.1f} GB/s)")
        ratio = f"   here/{args.against} speed {med[args.against] / med['here']:.2f}x" \
            if args.against else ""
        print(f"  {case:18s} " + "  ".join(cells) + ratio)


if __name__ == "__main__":
    main()
