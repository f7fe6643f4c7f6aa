"""Gemma's GeGLU fused (``FusedCpuOps.gelu_tanh_mul``, one C++ pass) against PyTorch's
``F.gelu(gate, approximate="tanh") * up`` (what served before), in one process, alternated.

    PYTHONPATH=. python benchmarks/gemma3_gguf.py /tmp/g3/gemma3-270m-shape-q4_0.gguf
    PYTHONPATH=. python benchmarks/geglu_fused.py /tmp/g3/gemma3-270m-shape-q4_0.gguf [--rounds 5]

The op alone at a prefill chunk of the Gemma 3 270M shape ([1493, 2 x 2048], best of 20), then
the engine's prefill of 16 prompts x 280 tokens (one token generated, median of ``--rounds``)
with the Python layers' GeGLU switched between the two; first tokens compared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.timing import best_seconds  # noqa: E402
from engine.cpu.kernels import load  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.models.layer_ops import FusedCpuOps, TorchLayerOps  # noqa: E402
from engine.quantization.linear import quant_kernels, vnni_available  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402


def _best_ms(f, reps: int = 20) -> float:
    return best_seconds(f, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a Gemma GGUF (benchmarks/gemma3_gguf.py writes one)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    fused_op = FusedCpuOps.gelu_tanh_mul
    ops = FusedCpuOps(load())
    vnni = " (AVX-512 VNNI built)" if vnni_available() else ""
    print(f"ISA {quant_kernels().quant_gemm_isa()}{vnni}, {torch.get_num_threads()} threads")
    gu = torch.randn(1493, 4096, generator=torch.Generator().manual_seed(0))
    a, b = _best_ms(lambda: TorchLayerOps.gelu_tanh_mul(gu)), _best_ms(lambda: ops.gelu_tanh_mul(gu))
    print(f"op alone [1493, 2 x 2048]: torch {a:.2f} ms, fused {b:.2f} ms: {a / b:.2f}x")
    llm = LLM(args.model, kv_cache_dtype="float16", enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(280)] for _ in range(16)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    sides = {"torch": lambda self, gate_up: TorchLayerOps.gelu_tanh_mul(gate_up), "fused": fused_op}
    runs: dict[str, list[float]] = {s: [] for s in sides}
    tokens: dict[str, list] = {}
    try:
        for _ in range(args.rounds):
            for side, op in sides.items():
                FusedCpuOps.gelu_tanh_mul = op
                t0 = time.perf_counter()
                out = llm.generate(prompts, params)
                runs[side].append(time.perf_counter() - t0)
                tokens.setdefault(side, [o.outputs[0].token_ids for o in out])
    finally:
        FusedCpuOps.gelu_tanh_mul = fused_op
    a, b = statistics.median(runs["torch"]), statistics.median(runs["fused"])
    same = sum(x == y for x, y in zip(tokens["torch"], tokens["fused"]))
    print(f"prefill 16 x 280 tokens (median of {args.rounds}): torch {a * 1e3:.0f} ms, fused "
          f"{b * 1e3:.0f} ms: {a / b:.3f}x; first tokens equal in {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
