"""The cost of batch-invariant greedy output (``EngineConfig.batch_invariant``) on W1.

    python benchmarks/batch_invariance.py                      # embedded model, CPU
    python benchmarks/batch_invariance.py --num-prompts 16 --rounds 1   # a quick look

W1's shape offline: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len``
greedy tokens each (ignore_eos), at most ``--concurrency`` sequences per step, through
``LLM.generate`` of two engines in this one process, the same weights and prompts: one with
``batch_invariant=False`` (the per-row-count kernel choice; float copies where the start-up
probe kept them) and one with ``batch_invariant=True`` (the default). Runs alternate
(off, on, off, on, ...) ``--rounds`` times; the best run of each is kept. Prints output
tokens/s of both, the ratio on/off, and how many prompts' tokens differ between the two (the
invariant engine is not meant to match the other, only itself in any batch).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=280)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    common = dict(max_num_seqs=args.concurrency, enable_prefix_caching=False, seed=args.seed)
    engines = {"off": LLM(args.model, batch_invariant=False, **common),
               "on": LLM(args.model, batch_invariant=True, **common)}
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    vocab = engines["on"].engine.runner.model.embed_tokens.num_embeddings
    prompts = [torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for llm in engines.values():  # warm-up: first-call allocations, kernel loads
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for r in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outs]
            best[name] = max(best.get(name, 0.0), n / wall)
            print(f"round {r + 1} {name:>3}: {n} tokens in {wall:.1f} s, {n / wall:.1f} tok/s",
                  flush=True)
    differ = sum(a != b for a, b in zip(tokens["off"], tokens["on"]))
    print(f"CPU: {_cpu()}; {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out, concurrency {args.concurrency}, best of {args.rounds}")
    print(f"batch_invariant off: {best['off']:.1f} out tok/s; on: {best['on']:.1f} out tok/s; "
          f"on/off = {best['on'] / best['off']:.3f}x; prompts whose tokens differ between "
          f"the two: {differ}/{args.num_prompts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
