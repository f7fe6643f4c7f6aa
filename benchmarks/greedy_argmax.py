"""The greedy token's argmax in two passes on a CPU (``engine.sampling.argmax.first_argmax``)
against PyTorch's single ``max(dim=-1)`` (what served before), in one process, alternated.

    PYTHONPATH=. python benchmarks/greedy_argmax.py [--model F.gguf] [--steps 64] [--rounds 5]

1. The op alone, both paths forced (best of 50), at the vocabularies of SmolLM2 (49,152),
   Llama 3 (128,256), Qwen (151,936) and Gemma 3 (262,144) and around the rule's border;
   indices compared; which path ``first_argmax`` takes at each shape.
2. The engine's decode steps with the sampler's argmax switched between the two: one stream
   and 16 streams (128 prompt tokens, ``--steps`` greedy tokens, medians of ``--rounds``,
   per generated token), tokens compared. The model defaults to the embedded SmolLM2 GGUF;
   ``benchmarks/gemma3_gguf.py`` writes a Gemma 3 270M-shaped one (262,144 logits).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import engine.sampling.argmax as argmax_module  # noqa: E402
import engine.sampling.sampler as sampler_module  # noqa: E402
from benchmarks.startup_time import isa  # noqa: E402
from benchmarks.timing import best_seconds, decode_step_seconds  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.embedded import embedded_gguf_path  # noqa: E402
from engine.sampling.argmax import first_argmax  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402


def single_pass(x: torch.Tensor) -> torch.Tensor:
    return x.max(dim=-1).indices


SIDES = {"max(dim=-1)": single_pass, "two passes": first_argmax}


def _best_us(f, reps: int = 50) -> float:
    return best_seconds(f, reps) * 1e6


# (rows, logits per row): the three vocabularies, and the region around the rule's border.
SHAPES = ((1, 49_152), (1, 80_000), (1, 128_256), (1, 151_936), (1, 262_144), (2, 32_768),
          (2, 65_536), (4, 32_000), (8, 8_192), (8, 16_384), (16, 49_152), (16, 151_936),
          (16, 262_144), (128, 2_048))


def op_table() -> None:
    """Both paths forced at each shape (best of 50, twice), and which one ``first_argmax``
    takes there: the rule must never take the slower one by a margin."""
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    rule = argmax_module.two_passes_pay
    for rows, width in SHAPES:
        x = torch.randn(rows, width, generator=g)
        argmax_module.two_passes_pay = lambda *_: True
        try:
            assert torch.equal(single_pass(x), first_argmax(x))
            a, b = (min(_best_us(lambda f=f, x=x: f(x)) for _ in range(2))
                    for f in SIDES.values())
        finally:
            argmax_module.two_passes_pay = rule
        chosen = "two passes" if rule(rows, width, threads) else "one pass"
        print(f"op {rows:3d} x {width:7,d}: max(dim=-1) {a:7.1f} us, two passes {b:6.1f} us: "
              f"{a / b:5.2f}x; first_argmax takes {chosen}")


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
            for r in tqdm(range(rounds), desc=f"{streams} stream(s), both sides in turn"):
                for side, f in list(SIDES.items())[::1 if r % 2 else -1]:  # ABBA order
                    sampler_module.first_argmax = f
                    step, out = decode_step_seconds(llm, prompts, first, params, steps)
                    runs[side].append(step)
                    tokens.setdefault(side, [o.outputs[0].token_ids for o in out])
        finally:
            sampler_module.first_argmax = first_argmax
        a, b = (statistics.median(runs[s]) * 1e3 for s in SIDES)
        same = tokens["max(dim=-1)"] == tokens["two passes"]
        print(f"engine, {streams:2d} stream(s), decode step: max(dim=-1) {a:.2f} ms, two passes "
              f"{b:.2f} ms: {a / b:.3f}x; tokens {'identical' if same else 'DIFFER'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"ISA {isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    op_table()
    engine_ab(args.model or str(embedded_gguf_path()), args.steps, args.rounds)


if __name__ == "__main__":
    main()
