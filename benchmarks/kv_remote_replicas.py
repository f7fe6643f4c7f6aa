"""The remote KV tier between replicas: replica B's TTFT on a prompt only replica A computed
(its prefix read from Redis) vs B's cold TTFT on a prompt of the same length, in one run.

Two processes share one ``redis-server`` (started here on a free loopback port, ``allkeys-lru``,
no persistence; or ``--url``). Replica A (a fresh process): a short warm-up prompt twice, then
prompt P (cold), then P again (a device prefix hit: the output the restored bytes must give),
and exits (its writer finishes the queued blocks at close). Replica B (a fresh process, its own
pools, nothing of P in memory): the same warm-up twice, then prompt Q (cold: same length, never
seen by anyone), then P (looked up in Redis on arrival, read into host memory, loaded). TTFT is
arrival to first token (the Redis look-up and reads count). Printed: both TTFTs and their
ratio, the share of P's prefix B reports cached, and whether B's greedy output on P equals A's
device-hit output and A's cold output. Targets (issue 58): cached >= 95 % of the prefix, TTFT
<= 1/3 of B's cold TTFT, outputs equal.

    python benchmarks/kv_remote_replicas.py                # embedded SmolLM2-135M, CPU
    python benchmarks/kv_remote_replicas.py --tiny         # a tiny random Llama, seconds
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import start_redis  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or GGUF (default: embedded)")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random Llama instead")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--url", default=None, help="an existing server (default: start one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # child: JSON args
    return ap.parse_args(argv)


def _child(spec: dict) -> None:
    """One replica's life: start, warm up, run its prompts, print JSON, exit."""
    from engine import LLM, SamplingParams

    llm = LLM(spec["model"], kv_remote_url=spec["url"])
    sp = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate([spec["warmup"]], [sp])  # twice: the full-prefill path and the path of a
    llm.generate([spec["warmup"]], [sp])  # prefix hit (last tokens over cached KV) both warm
    out = {}
    for name, prompt in spec["prompts"]:
        r = llm.generate([prompt], [sp])[0]
        out[name] = {"ttft": r.metrics.first_token_time - r.metrics.arrival_time,
                     "cached": r.num_cached_tokens, "tokens": r.outputs[0].token_ids}
    stats = llm.stats()
    llm.close()
    out["stats"] = {k: v for k, v in stats.items() if k.startswith("remote_")}
    print(json.dumps(out))


def _phase(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--phase", json.dumps(spec)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.phase is not None:
        _child(json.loads(args.phase))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="kv-remote-replicas-"))
    model = args.model
    if args.tiny:
        from engine.loading.tiny import make_tiny_model_dir

        model = str(make_tiny_model_dir(tmp / "tiny", "llama", max_position_embeddings=4096))
    if model is None:
        from engine.loading.embedded import EMBEDDED_MODEL_NAME

        model = EMBEDDED_MODEL_NAME
    proc, url = None, args.url
    if url is None:
        proc, host, port = start_redis(tmp)
        url = f"redis://{host}:{port}/0"
    try:
        rng = random.Random(args.seed)
        hi = 250 if args.tiny else 30000
        p, q, warmup = ([rng.randrange(10, hi) for _ in range(n)]
                        for n in (args.prompt_tokens, args.prompt_tokens, 48))
        base = {"model": model, "url": url, "warmup": warmup, "max_tokens": args.max_tokens}
        a = _phase({**base, "prompts": [("cold", p), ("hit", p)]})
        b = _phase({**base, "prompts": [("cold", q), ("remote", p)]})
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    prefix = (len(p) - 1) // 16 * 16  # full blocks; a hit never covers the last token
    cold, warm = b["cold"]["ttft"], b["remote"]["ttft"]
    share = b["remote"]["cached"] / prefix
    same_hit = b["remote"]["tokens"] == a["hit"]["tokens"]
    same_cold = b["remote"]["tokens"] == a["cold"]["tokens"]
    print(f"model {model} | prompt {len(p)} tokens | {args.max_tokens} generated | greedy | "
          f"each replica a fresh process | Redis at {url}")
    print(f"{'B cold TTFT s':>14}{'B from Redis s':>16}{'ratio':>8}{'cached':>9}"
          f"{'= A hit':>9}{'= A cold':>10}")
    print(f"{cold:14.3f}{warm:16.3f}{warm / cold:8.3f}{share:9.1%}{str(same_hit):>9}"
          f"{str(same_cold):>10}   (A cold TTFT {a['cold']['ttft']:.3f} s; A wrote "
          f"{a['stats']['remote_written_blocks']}, dropped {a['stats']['remote_dropped_writes']};"
          f" B read {b['stats']['remote_hit_blocks']} blocks)")
    ok = share >= 0.95 and warm <= cold / 3 and same_hit
    print("targets (cached >= 95% of the prefix, TTFT <= 1/3 of B's cold, output = A's):",
          "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
