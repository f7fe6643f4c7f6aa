"""The greedy token's argmax on a CPU: the C++ kernel ``first_argmax_rows`` (what
``engine.sampling.argmax.first_argmax`` takes where the CPU kernels are built), the two passes of
PyTorch ops (what it takes without them) and PyTorch's single ``max(dim=-1)``, in one process,
alternated.

    PYTHONPATH=. python benchmarks/greedy_argmax.py [--model F.gguf] [--steps 64] [--rounds 6]

1. The op alone, each path forced (best of 50), at the vocabularies of SmolLM2 (49,152),
   Llama 3 (128,256), Qwen (151,936) and Gemma 3 (262,144) and around the two-pass rule's
   border, warm and cold (each call right after a 200 MB read has flushed the caches, as the
   logits head does in a decode step); indices compared.
2. The engine's decode steps with the sampler's argmax switched between the three: one stream
   and 16 streams (128 prompt tokens, ``--steps`` greedy tokens, medians of ``--rounds``,
   per generated token), tokens compared. The model defaults to the embedded SmolLM2 GGUF;
   ``benchmarks/gemma3_gguf.py`` writes a Gemma 3 270M-shaped one (262,144 logits).
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
from tqdm import tqdm  # noqa: E402

import engine.sampling.sampler as sampler_module  # noqa: E402
from benchmarks.startup_time import isa  # noqa: E402
from benchmarks.timing import best_seconds, decode_step_seconds  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.embedded import embedded_gguf_path  # noqa: E402
from engine.sampling.argmax import first_argmax, two_passes  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402


def single_pass(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=-1).indices


SIDES = {"max(dim=-1)": single_pass, "two passes": two_passes, "kernel": first_argmax}


# (rows, logits per row): the vocabularies, and the region around the two-pass rule's border.
SHAPES = ((1, 49_152), (1, 80_000), (1, 128_256), (1, 151_936), (1, 262_144), (2, 32_768),
          (2, 65_536), (4, 32_000), (8, 8_192), (8, 16_384), (16, 49_152), (16, 151_936),
          (16, 262_144), (128, 2_048))


def _cold_us(f, flush: torch.Tensor, reps: int = 15) -> float:
    """The median of ``reps`` calls, each right after reading ``flush`` (caches flushed)."""
    times = []
    for _ in range(reps):
        flush.sum()
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def op_table() -> None:
    """Each path forced at each shape, warm (best of 50, twice) and cold (median of 15)."""
    g = torch.Generator().manual_seed(0)
    flush = torch.randn(50_000_000, generator=g)  # 200 MB
    for rows, width in tqdm(SHAPES, desc="op shapes"):
        x = torch.randn(rows, width, generator=g)
        want = x.argmax(dim=-1)
        assert all(torch.equal(f(x), want) for f in SIDES.values())
        warm = [min(best_seconds(lambda f=f, x=x: f(x), 50) for _ in range(2)) * 1e6
                for f in SIDES.values()]
        cold = [_cold_us(lambda f=f, x=x: f(x), flush) for f in SIDES.values()]
        for what, (a, b, c) in (("warm", warm), ("cold", cold)):
            tqdm.write(f"op {rows:3d} x {width:7,d} {what}: max(dim=-1) {a:7.1f} us, two passes "
                       f"{b:6.1f} us, kernel {c:6.1f} us: {a / c:5.2f}x / {b / c:5.2f}x")


def engine_ab(model: str, steps: int, rounds: int) -> None:
    llm = LLM(model, kv_cache_dtype="float16", enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for streams in (1, 16):
        prompts = [[rng.randrange(100, 20000) for _ in range(128)] for _ in range(streams)]
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params)
        runs: dict[str, list[float]] = {s: [] for s in SIDES}
        tokens: dict[str, list] = {}
        try:
            sides = list(SIDES.items())
            for r in tqdm(range(rounds), desc=f"{streams} stream(s), the sides in turn"):
                # Each side in each position equally often (ABC, BCA, CAB, ...): the position in
                # a round measured up to 7% on its own (the middle of ABC/CBA was favoured).
                for side, f in sides[r % len(sides):] + sides[:r % len(sides)]:
                    sampler_module.first_argmax = f
                    step, out = decode_step_seconds(llm, prompts, first, params, steps)
                    runs[side].append(step)
                    tokens.setdefault(side, [o.outputs[0].token_ids for o in out])
        finally:
            sampler_module.first_argmax = first_argmax
        a, b, c = (statistics.median(runs[s]) * 1e3 for s in SIDES)
        same = len({str(t) for t in tokens.values()}) == 1
        print(f"engine, {streams:2d} stream(s), decode step: max(dim=-1) {a:.2f} ms, two passes "
              f"{b:.2f} ms, kernel {c:.2f} ms: {a / c:.3f}x / {b / c:.3f}x; tokens "
              f"{'identical' if same else 'DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    print(f"ISA {isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    op_table()
    engine_ab(args.model or str(embedded_gguf_path()), args.steps, args.rounds)


if __name__ == "__main__":
    main()
