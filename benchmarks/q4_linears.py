"""A model's 4-bit blocked linears (engine/cpu/csrc/quant_gemm_q4_blocked.cpp) as a decode step
calls them, weights from DRAM; optionally next to another commit's kernel.

    python benchmarks/q4_linears.py                                  # the embedded model
    python benchmarks/q4_linears.py --model gemma3.gguf --against HEAD~1   # runs alternated
    python benchmarks/q4_linears.py --model gemma3.gguf --head --against HEAD~1   # the head

The model is loaded as the engine serves it (its start-up probe picks the layout); every blocked
linear of its layer stack (qkv, o, gate_up, down of each layer, in that order) is called on
``rows`` random activation rows (1: a single stream's decode step; 2; 16: sixteen streams), so
that one pass reads every layer's weights once, more bytes than the last-level cache holds (the
Gemma 3 270M-shaped Q4_0 file of benchmarks/gemma3_gguf.py: 56 MB; SmolLM2's Q4_1: 66 MB).
``--head`` times the logits head instead, through its module (the Gemma 3 shape's: 178 MB).
Each case reports the median time of a pass over ``--repeats`` and its weight bytes per second.
With ``--against REV`` that commit is checked out into a worktree (benchmarks/commit_ab.py),
the same cases run there and here in alternating fresh processes (``--rounds``), and the ratio
of the medians is printed per case. The kernels run on as many threads as the engine
sets (its default: every core this process may use).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 2, 16)

MEASURE = r'''
import json, sys, time
sys.path.insert(0, ".")
import torch
from engine import LLM
from engine.cpu.kernels import load
from engine.quantization.linear import QuantLinear

opts = json.loads(sys.argv[1])
kernel = load()
llm = LLM(opts["model"], kv_cache_memory="64MiB")
model = llm.engine.runner.model
layers = getattr(model, "model", model).layers
if opts["head"]:  # the logits head alone, through its module (any layout)
    mods = [model.lm_head if getattr(model, "lm_head", None) is not None else model.tied_head]
else:
    mods = [getattr(layer, name) for layer in layers
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    mods = [m for m in mods if isinstance(m, QuantLinear) and m.blocked]
results = {"bytes": sum(t.numel() * t.element_size() for m in mods for t in (m.qs, m.d, m.m)
                        if t is not None),
           "linears": len(mods)}
torch.manual_seed(0)
for rows in opts["rows"]:
    xs = [torch.randn(rows, m.in_features) for m in mods]

    def step():
        for m, x in zip(mods, xs):
            if opts["head"]:
                m(x)
            else:
                kernel.quant_gemm_q4_blocked(x, m.qs, m.d, m.m, m.out_features,
                                             m.kernels.q4_tiles == "vnni")

    step()
    times = []
    for _ in range(opts["repeats"]):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    results[str(rows)] = sorted(times)[len(times) // 2]
print("RESULT " + json.dumps(results))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--against", default=None, help="a commit to run side by side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head", action="store_true",
                    help="time the logits head (its packed module) instead of the layer linears")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from commit_ab import here_and_against

    from engine.loading.embedded import embedded_gguf_path

    model = str(Path(args.model).resolve()) if args.model else str(embedded_gguf_path())
    opts = {"model": model, "rows": ROWS, "repeats": args.repeats, "head": args.head}
    runs = here_and_against(MEASURE, opts, args.against, args.rounds)
    sides = list(runs)
    first = runs["here"][0]
    what = "logits head" if args.head else "blocked linears"
    print(f"{Path(model).name}: {first['linears']} {what}, "
          f"{first['bytes'] / 1e6:.1f} MB; median ms per pass")
    for rows in ROWS:
        med = {name: statistics.median(r[str(rows)] for r in rs) for name, rs in runs.items()}
        cells = [f"{name} {med[name] * 1e3:7.3f} ms ({first['bytes'] / med[name] / 1e9:5.1f} GB/s)"
                 for name in sides]
        ratio = f"   here/{args.against} speed {med[args.against] / med['here']:.2f}x" \
            if args.against else ""
        print(f"  {rows:2d} rows  " + "  ".join(cells) + ratio)


if __name__ == "__main__":
    main()
