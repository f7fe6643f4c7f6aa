"""Which dtype should the CPU path default to? bf16 vs fp32 linears, side by side, one run.

    python benchmarks/dtype_matmul.py

Times the embedded model's fused matmul shapes (576x1728 QKV, 576x3072 gate/up, 1536x576 down)
at 1, 32 and 256 rows in float32 and bfloat16 and prints GFLOP/s and the bf16/fp32 ratio, plus
what ``dtype="auto"`` picks on this machine for a float checkpoint of the embedded model's
shape (measured: engine/runner/dtype_probe.py; a packed GGUF always runs float32 activations,
its prefill panels' dtype probed separately).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.yardstick import _time_linear  # noqa: E402
from engine.runner.dtype_choice import cpu_has_bf16, resolve_dtype  # noqa: E402

SHAPES = [(576, 1728), (576, 3072), (1536, 576)]


def main() -> int:
    rows_list = [1, 32, 256]
    results: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for dtype in tqdm(["float32", "bfloat16"], desc="dtypes"):
            dt = getattr(torch, dtype)
            for rows in rows_list:
                rate = 0.0
                for k, n in SHAPES:
                    x, w = torch.randn(rows, k, dtype=dt), torch.randn(n, k, dtype=dt)
                    rate += max(_time_linear(x, w, 0.2) for _ in range(3))
                results[(dtype, rows)] = rate / len(SHAPES) / 1e9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"native bf16: {cpu_has_bf16()}")
    print(f"{'rows':>5} {'fp32 GFLOP/s':>13} {'bf16 GFLOP/s':>13} {'bf16/fp32':>10}")
    for rows in rows_list:
        f32, b16 = results[("float32", rows)], results[("bfloat16", rows)]
        print(f"{rows:>5} {f32:>13.1f} {b16:>13.1f} {b16 / f32:>9.2f}x")
    smollm2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
               "num_key_value_heads": 3, "num_hidden_layers": 30}
    picked = str(resolve_dtype("auto", torch.device("cpu"), "auto", smollm2)).removeprefix("torch.")
    print(f"dtype='auto' picks {picked} on this CPU for a float checkpoint of this shape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
