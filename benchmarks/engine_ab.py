"""Two engine settings on the same workload in one process, steps interleaved: an A/B that a
noisy shared machine cannot bias (both sides see the same load at the same moment).

    python benchmarks/engine_ab.py KVSERVE_PACKED_LINEAR=onednn KVSERVE_PACKED_LINEAR=hybrid
    python benchmarks/engine_ab.py KVSERVE_CPU_KERNELS=0 KVSERVE_CPU_KERNELS=1 --prompts 16
    python benchmarks/engine_ab.py KVSERVE_DECODE_STACK=0 KVSERVE_DECODE_STACK=1 --model F.gguf

Each side is given as ``VAR=value`` (an environment switch the engine reads at start-up; see
docs/envs.md; figures in docs/performance.md). Both engines (embedded model or ``--model``,
float32, greedy, ignore_eos) get the same random prompts; then step i of A, step i of B, and so on. Prints the summed time of prefill
steps and of decode-only steps for each side, the B/A speed ratios, and whether the generated
tokens are identical.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.params.sampling import SamplingParams  # noqa: E402


def _engine(setting: str, kv_memory: str, model: str | None):
    var, _, value = setting.partition("=")
    if not var or not _:
        raise SystemExit(f"settings look like VAR=value; got {setting!r}")
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        return LLM(model, dtype="float32", kv_cache_memory=kv_memory).engine
    finally:  # the switch is read at start-up; restore it for the other side
        if old is None:
            os.environ.pop(var)
        else:
            os.environ[var] = old


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--kv-cache-memory", default="1GiB", help="per engine")
    ap.add_argument("--model", default=None, help="HF directory or GGUF (default: embedded)")
    args = ap.parse_args()
    engines = {s: _engine(s, args.kv_cache_memory, args.model) for s in (args.a, args.b)}
    rng = random.Random(0)
    vocab = next(iter(engines.values())).tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.input_len)]
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    times, tokens = interleave(engines, prompts, params)
    report(args.a, args.b, times, tokens, f"{args.prompts} prompts x {args.input_len} tokens, "
           f"{args.output_len} output tokens")
    return 0


def interleave(engines: dict, prompts: list[list[int]], params: SamplingParams):
    """Every prompt into every engine, then step i of each engine in turn until all finish.
    Returns per engine the summed seconds of prefill and of decode-only steps, and the
    generated tokens per request."""
    for eng in engines.values():
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
    times: dict[str, dict[str, float]] = {s: {"prefill": 0.0, "decode": 0.0} for s in engines}
    tokens: dict[str, dict[str, list[int]]] = {s: {} for s in engines}
    bar = tqdm(total=len(prompts) * len(engines), desc="requests")
    while any(e.has_unfinished_requests() for e in engines.values()):
        for s, eng in engines.items():
            if not eng.has_unfinished_requests():
                continue
            prefill = bool(eng.scheduler.waiting) or any(
                q.num_computed_tokens < len(q.token_ids) - 1 for q in eng.scheduler.running)
            start = time.perf_counter()
            outs = eng.step()
            times[s]["prefill" if prefill else "decode"] += time.perf_counter() - start
            for o in outs:
                if o.finished:
                    tokens[s][o.request_id] = list(o.outputs[0].token_ids)
                    bar.update(1)
    bar.close()
    return times, tokens


def report(a: str, b: str, times, tokens, workload: str) -> None:
    """Print both sides' step times, the B/A speed ratios and whether the tokens agree."""
    print(f"{workload}, {torch.get_num_threads()} threads, steps interleaved")
    for s in (a, b):
        print(f"  {s:<40} prefill steps {times[s]['prefill']:7.2f} s   "
              f"decode steps {times[s]['decode']:7.2f} s")
    for phase in ("prefill", "decode"):
        if times[b][phase] > 0:
            print(f"  {phase}: B is {times[a][phase] / times[b][phase]:.2f}x A")
    same = sum(tokens[a][k] == tokens[b].get(k) for k in tokens[a])
    print(f"  identical generated tokens: {same}/{len(tokens[a])} requests")

if __name__ == "__main__":
    sys.exit(main())
