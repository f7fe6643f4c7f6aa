"""Two commits of kvserve on the same workload, runs alternated: A, B, A, B, ...

    python benchmarks/commit_ab.py HEAD~1 HEAD --rounds 2
    python benchmarks/commit_ab.py ca9e610 WORKTREE      # WORKTREE: this checkout as it is
    python benchmarks/commit_ab.py HEAD WORKTREE --model F.gguf --prefix-len 1480 --kv-cache-dtype float16

For a change that must not change behaviour or speed (a refactor, a move): each commit is checked
out once into a git worktree under ``$XDG_CACHE_HOME/kvserve/commit-ab`` (reused), and each round
runs the same workload there in a fresh process: the embedded model (or ``--model``), float32,
16 fixed random prompts of 40-200 tokens (``--sequences``; 1: a single stream; after a shared
random prefix of ``--prefix-len`` tokens, whose prefill is then timed in each call too: every
call's prompts get a fresh prefix), 48 greedy tokens each (``--max-tokens``), best of 3 timed
``LLM.generate`` calls. It
prints each side's best time and tokens per second, the B/A ratio of the medians over rounds, and
whether the generated tokens were identical across every run (a hash). The workload uses only the
public API (``from engine import LLM, SamplingParams``), so it runs on any layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = r'''
import hashlib, json, random, sys, time
sys.path.insert(0, ".")
from engine import LLM, SamplingParams
opts = json.loads(sys.argv[1])
llm = LLM(opts["model"], dtype="float32", kv_cache_memory="256MiB",
          kv_cache_dtype=opts["kv_cache_dtype"])
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(40, 200))]
           for _ in range(opts["sequences"])]
params = SamplingParams(max_tokens=opts["max_tokens"], temperature=0, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))
best, digests = float("inf"), []
for _ in range(3):
    prefix = [rng.randrange(100, 40000) for _ in range(opts["prefix_len"])]
    t = time.perf_counter()
    outs = llm.generate([prefix + p for p in prompts], params)
    best = min(best, time.perf_counter() - t)
    digests.append([o.outputs[0].token_ids for o in outs])
digest = hashlib.sha1(str(digests).encode()).hexdigest()[:12]
print(f"RESULT {best:.4f} {digest}")
'''


def _checkout(rev: str, cache: Path) -> Path:
    if rev == "WORKTREE":
        return ROOT
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = cache / sha[:12]
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT,
                       check=True, capture_output=True)
    return path


def checkout(rev: str) -> Path:
    """``rev``'s checkout (a git worktree under the cache, reused), or this one for WORKTREE."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "commit-ab"
    cache.mkdir(parents=True, exist_ok=True)
    return _checkout(rev, cache)


def run_script(path: Path, script: str, opts: dict) -> str:
    """``script`` run in a fresh Python in the checkout at ``path`` with ``opts`` (JSON) as its
    argument: the text after ``RESULT `` on its output's line that starts so."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    if path != ROOT:  # its own CPU-kernel build cache: the sources' path is part of torch's key
        env["TORCH_EXTENSIONS_DIR"] = str(path.parent / f"{path.name}.torch_extensions")
    out = subprocess.run([sys.executable, "-c", script, json.dumps(opts)], cwd=path, env=env,
                         check=True, capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"no result from {path}:\n{out[-2000:]}")
    return line[len("RESULT "):]


def here_and_against(script: str, opts: dict, against: str | None,
                     rounds: int) -> dict[str, list[dict]]:
    """``script``'s JSON results (run_script) per side: "here" (this checkout) once, or with
    ``against`` (a commit) ``rounds`` times each, the two alternated (``against`` first)."""
    sides = {against: checkout(against), "here": ROOT} if against else {"here": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    with tqdm(total=(rounds if against else 1) * len(sides), desc="runs") as bar:
        for _ in range(rounds if against else 1):
            for name, path in sides.items():
                runs[name].append(json.loads(run_script(path, script, opts)))
                bar.update(1)
    return runs


def _run(path: Path, opts: dict) -> tuple[float, str]:
    seconds, digest = run_script(path, WORKLOAD, opts).split()
    return float(seconds), digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="commit (or WORKTREE)")
    ap.add_argument("b", help="commit (or WORKTREE)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="HF directory or GGUF (default: embedded)")
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="tokens of a random prefix all prompts share (fresh each call)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--sequences", type=int, default=16, help="prompts per call (1: one stream)")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    args = ap.parse_args()
    opts = {"model": str(Path(args.model).resolve()) if args.model else None,
            "prefix_len": args.prefix_len, "kv_cache_dtype": args.kv_cache_dtype,
            "sequences": args.sequences, "max_tokens": args.max_tokens}
    sides = {name: checkout(rev) for name, rev in (("A", args.a), ("B", args.b))}
    times: dict[str, list[float]] = {"A": [], "B": []}
    digests: set[str] = set()
    tokens = args.sequences * args.max_tokens
    with tqdm(total=2 * args.rounds, desc="runs") as bar:
        for _ in range(args.rounds):
            for name, path in sides.items():
                seconds, digest = _run(path, opts)
                times[name].append(seconds)
                digests.add(digest)
                bar.update(1)
                tqdm.write(f"{name} ({getattr(args, name.lower())}): {seconds:.2f} s "
                           f"({tokens / seconds:.1f} tok/s), tokens {digest}")
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"median A {tokens / a:.1f} tok/s, B {tokens / b:.1f} tok/s: B/A speed {a / b:.3f}")
    print(f"generated tokens identical across all runs: {len(digests) == 1}")


if __name__ == "__main__":
    main()
