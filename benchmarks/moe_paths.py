"""The three GPU paths of a mixture-of-experts layer side by side, on an NVIDIA GPU: the fused
Triton grouped GEMMs (kvserve_kernels/fused_moe.py, the default on CUDA), the per-expert loop
(``grouped``: one host sync, not capturable) and ``dense`` (every expert on every token: what a
CUDA-graph capture used before the fused kernels).

One layer of Qwen3-30B-A3B's shape by default (128 experts, top 8, hidden 2,048, expert
intermediate 768, bf16, random weights, router logits from a random router so that tokens
spread as a trained model's roughly do). For each token count: median of ``--iters`` CUDA-event
timings after warm-up, eager for every path and, for ``fused`` and ``dense``, replayed from a
CUDA graph (the decode step's case); the fused path's largest difference from the loop; the
ratios loop / fused and dense / fused (> 1: fused is faster).

    python benchmarks/moe_paths.py [--tokens 1,8,16,64,256,2048] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.models.moe import MoeExperts, route  # noqa: E402


def _median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _graphed(fn):
    """``fn`` captured once into a CUDA graph (after an eager warm-up); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--tokens", default="1,8,16,64,256,2048")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_paths.py times GPU paths: no CUDA device here")
        return 2
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    experts = MoeExperts(args.experts, args.hidden, args.intermediate).to(dev, dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, args.hidden ** -0.5)
        experts.down_proj.normal_(0, args.intermediate ** -0.5)
    router = torch.randn(args.experts, args.hidden, device=dev, dtype=dtype) * 0.05
    rows = []
    print(f"{torch.cuda.get_device_name()}: E={args.experts} k={args.top_k} "
          f"H={args.hidden} I={args.intermediate} bf16")
    print("milliseconds; 'graph': replayed from a CUDA graph")
    print(f"{'tokens':>7} {'fused':>9} {'loop':>9} {'dense':>9} {'fused gr':>9} {'dense gr':>9}"
          f" {'loop/fused':>10} {'dense gr/fused gr':>17} {'max diff':>9}")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, args.hidden, device=dev, dtype=dtype)
        weights, ids = route(x @ router.t(), args.top_k, normalise=True)

        def run(path, x=x, weights=weights, ids=ids):
            def call():
                experts.path = path
                return experts(x, weights, ids)
            return call

        with torch.inference_mode():
            diff = (run("fused")().float() - run("grouped")().float()).abs().max().item()
            row = {"tokens": t, "max_abs_diff_vs_loop": diff}
            for path in ("fused", "grouped", "dense"):
                row[f"{path}_ms"] = _median_ms(run(path), args.iters)
            for path in ("fused", "dense"):
                row[f"{path}_graph_ms"] = _median_ms(_graphed(run(path)), args.iters)
        row["loop_over_fused"] = row["grouped_ms"] / row["fused_ms"]
        row["dense_over_fused_graphs"] = row["dense_graph_ms"] / row["fused_graph_ms"]
        rows.append(row)
        print(f"{t:>7} {row['fused_ms']:>9.3f} {row['grouped_ms']:>9.3f} {row['dense_ms']:>9.3f}"
              f" {row['fused_graph_ms']:>9.3f} {row['dense_graph_ms']:>9.3f}"
              f" {row['loop_over_fused']:>10.2f} {row['dense_over_fused_graphs']:>17.2f}"
              f" {diff:>9.2e}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "shape": vars(args) | {"json": None},
                                         "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
