"""The sampler's cost per step for top-k / top-p sampling: within the candidates
(engine/sampling/truncated.py, engine/sampling/candidates.py) against the general path over
the masked full row (what served before), in one process, alternated.

    PYTHONPATH=. python benchmarks/sampling_cost.py [--repeats 20] [--model F.gguf --rounds 5]

Logits shaped like a language model's (probabilities ~ rank^-1.2 at shuffled positions), the
vocabularies of SmolLM2 (49,152) and Gemma 3 (262,144), 1 and 16 rows, three settings:
Gemma's generation defaults (temperature 1, top-k 64, top-p 0.95, applied to every request
that sets none), a chat client's temperature 0.7 / top-p 0.9, and top-k 40. Medians of
``--repeats`` calls; tokens of seeded rows compared (equal but where a uniform falls within
float rounding of a boundary).

With ``--model``: the engine's decode steps too, 16 streams (128 prompt tokens, 64 sampled
tokens with Gemma's defaults, seeded), the sampler's rule switched between the two, medians of
``--rounds`` per generated token (``benchmarks/gemma3_gguf.py`` writes a Gemma 3 270M-shaped
file: 262,144 logits).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import engine.sampling.sampler as sampler_module  # noqa: E402
from benchmarks.startup_time import isa  # noqa: E402
from benchmarks.timing import decode_step_seconds  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402
from engine.sampling.row import SamplingRow  # noqa: E402
from engine.sampling.sampler import Sampler  # noqa: E402

SETTINGS = {
    "Gemma defaults (t 1, top-k 64, top-p 0.95)": {"temperature": 1.0, "top_k": 64,
                                                   "top_p": 0.95},
    "t 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "t 1, top-k 40": {"temperature": 1.0, "top_k": 40},
}


def zipf_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = -1.2 * torch.arange(1, vocab + 1, dtype=torch.float32).log()
    return torch.stack([ranks[torch.randperm(vocab, generator=g)] for _ in range(rows)])


def rows_of(n: int, params: dict, seed0: int) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(seed=seed0 + i, **params), [1], [],
                        torch.Generator().manual_seed(seed0 + i), frozenset())
            for i in range(n)]


def engine_ab(model: str, rounds: int) -> None:
    import random

    from engine.llm import LLM

    llm = LLM(model, kv_cache_dtype="float16", enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(128)] for _ in range(16)]
    steps = 64
    truncates = sampler_module.truncates
    sides = {"general": lambda *_: False, "candidates": truncates}
    times: dict[str, list[float]] = {s: [] for s in sides}
    tokens: dict[str, list] = {}

    def params(n: int) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=n, ignore_eos=True, seed=i,
                               **SETTINGS["Gemma defaults (t 1, top-k 64, top-p 0.95)"])
                for i in range(len(prompts))]

    llm.generate(prompts, params(4))
    try:
        for r in tqdm(range(rounds), desc="engine, 16 streams, both sides in turn"):
            for side, rule in list(sides.items())[::1 if r % 2 else -1]:
                sampler_module.truncates = rule
                step, out = decode_step_seconds(llm, prompts, params(1), params(steps), steps)
                times[side].append(step)
                tokens.setdefault(side, [o.outputs[0].token_ids for o in out])
    finally:
        sampler_module.truncates = truncates
    a, b = (statistics.median(times[s]) * 1e3 for s in sides)
    same = sum(x == y for x, y in zip(tokens["general"], tokens["candidates"]))
    print(f"engine, 16 streams, Gemma defaults, decode step: general {a:.2f} ms, candidates "
          f"{b:.2f} ms: {a / b:.3f}x; sequences equal {same}/{len(prompts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--model", default=None, help="a GGUF: also the engine's decode steps")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"ISA {isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    truncates = sampler_module.truncates
    sides = {"general": lambda *_: False, "candidates": truncates}
    for vocab in (49_152, 262_144):
        for n in (1, 16):
            x = zipf_logits(n, vocab)
            for name, params in SETTINGS.items():
                times: dict[str, list[float]] = {s: [] for s in sides}
                tokens: dict[str, list[int]] = {s: [] for s in sides}
                try:
                    for r in tqdm(range(args.repeats), leave=False, desc=f"{vocab} x {n}"):
                        for side, rule in list(sides.items())[::1 if r % 2 else -1]:
                            sampler_module.truncates = rule
                            rows = rows_of(n, params, 1000 * r)
                            t0 = time.perf_counter()
                            out = Sampler(seed=r)(x, rows)
                            times[side].append(time.perf_counter() - t0)
                            tokens[side] += out.token_ids
                finally:
                    sampler_module.truncates = truncates
                a, b = (statistics.median(times[s]) * 1e3 for s in sides)
                same = sum(p == q for p, q in zip(tokens["general"], tokens["candidates"]))
                print(f"{vocab:7,d} x {n:2d} {name:42s}: general {a:7.2f} ms, candidates "
                      f"{b:6.2f} ms: {a / b:5.2f}x; tokens equal {same}/{len(tokens['general'])}")
    if args.model:
        engine_ab(args.model, args.rounds)


if __name__ == "__main__":
    main()
