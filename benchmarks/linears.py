"""The CPU linear implementations side by side, one run: F.linear, oneDNN packed, AVX2 panels.

    python benchmarks/linears.py                 # rows 1, 16, 64, 128, 256, 2048
    python benchmarks/linears.py --rows 16 64 --seconds 1

For each of the embedded model's linear shapes (fused QKV 576x960, O 576x576, fused gate/up
576x3072, down 1536x576, logits 576x49152) and each row count, times a pass over 30 distinct
weights (one per layer, so they stream from memory as in a real step, not from cache) through
each implementation, and prints GFLOP/s and the ratio of each packed backend to F.linear. The
engine's ``hybrid`` backend uses the panels up to ``SMALL_ROWS`` rows and oneDNN above.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.quantization.packed_linear import (  # noqa: E402
    SMALL_ROWS,
    PackedLinear,
    onednn_linear_available,
    panel_kernels_available,
)

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
LAYERS = 30


def _rate(fns, x, flops: float, seconds: float) -> float:
    for fn in fns[:2]:
        fn(x)
    best = 0.0
    for _ in range(3):  # best of 3 windows: discounts other load on a shared machine
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            for fn in fns:
                fn(x)
            n += 1
        best = max(best, flops * n / (time.perf_counter() - start))
    return best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 2048])
    ap.add_argument("--seconds", type=float, default=0.6, help="timing per cell")
    args = ap.parse_args()
    cpu = torch.device("cpu")
    impls = ["torch"]
    if onednn_linear_available(cpu, torch.float32):
        impls.append("onednn")
    if panel_kernels_available(cpu, torch.float32):
        impls.append("avx2-panels")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, "
          f"{LAYERS} distinct weights per shape; hybrid = panels up to {SMALL_ROWS} rows")
    print(f"{'rows':>5} {'shape':>10} " + " ".join(f"{i:>12}" for i in impls)
          + " " + " ".join(f"{i + '/torch':>18}" for i in impls[1:]))
    torch.manual_seed(0)
    with torch.inference_mode():
        cells = [(r, s) for r in args.rows for s in SHAPES]
        for rows, (k, n) in tqdm(cells, desc="linears", leave=False):
            layers = 1 if n > 10_000 else LAYERS  # one logits head per model
            weights = [torch.randn(n, k) for _ in range(layers)]
            x = torch.randn(rows, k)
            flops = 2.0 * rows * k * n * layers
            rates = {}
            for impl in impls:
                if impl == "torch":
                    fns = [lambda x, w=w: F.linear(x, w) for w in weights]
                else:
                    fns = [PackedLinear(w, None, impl) for w in weights]
                rates[impl] = _rate(fns, x, flops, args.seconds)
            tqdm.write(f"{rows:>5} {f'{k}x{n}':>10} "
                       + " ".join(f"{rates[i]:>12.1f}" for i in impls) + " "
                       + " ".join(f"{rates[i] / rates['torch']:>17.2f}x" for i in impls[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
