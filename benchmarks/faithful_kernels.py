"""The faithful packed kernels against the batch-invariant int8 kernel, kernel level: one pass
over SmolLM2-135M's linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
tied head 49152x576; random 4-bit weights) at each row count, thread CPU time
(``time.thread_time``: robust to a busy machine's scheduling), the three kernels interleaved,
best of 25. Run single-threaded:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/faithful_kernels.py 1 4 16
"""

from __future__ import annotations

import sys
import time

import torch

from engine.cpu import kernels_faithful as kf
from engine.quantization.blocked import to_blocked
from engine.quantization.linear import quant_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def main() -> None:
    torch.set_num_threads(1)
    k = quant_kernels()
    g = torch.Generator().manual_seed(0)
    ws = []
    for n, kk in SHAPES:
        qs = torch.randint(0, 256, (n, kk // 2), dtype=torch.uint8, generator=g)
        d, m = torch.rand(n, kk // 32), -torch.rand(n, kk // 32)
        ws.append((qs, d, m, to_blocked(qs, d, m), n))
    print(f"faithful kernels: {kf.isa()}")
    for rows in [int(a) for a in sys.argv[1:]] or (1, 4, 16):
        xs = {kk: torch.randn(rows, kk) for _, kk in SHAPES}
        fns = {
            "bf16": lambda xs=xs: [kf.gemm(xs[w[0].shape[1] * 2], *w[:3], bf16=True) for w in ws],
            "f32": lambda xs=xs: [kf.gemm(xs[w[0].shape[1] * 2], *w[:3], bf16=False) for w in ws],
            "int8-blocked": lambda xs=xs: [k.quant_gemm_q4_blocked(xs[w[0].shape[1] * 2], *w[3], w[4],
                                                             True, False) for w in ws],
        }
        best = dict.fromkeys(fns, 1e9)
        for _ in range(25):
            for name, fn in fns.items():
                start = time.thread_time()
                fn()
                best[name] = min(best[name], time.thread_time() - start)
        print(rows, {name: round(s * 1e3, 3) for name, s in best.items()}, flush=True)


if __name__ == "__main__":
    main()
