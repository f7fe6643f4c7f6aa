"""``kvserve bench utilisation``: how much reserved KV memory holds live tokens, paged blocks vs
contiguous per-request pre-allocation (the seed's §3.2 claim: under 50% -> over 80%).

    kvserve bench utilisation [MODEL] [--max-model-len N] [--json PATH] [--plot DIR]

The engine runs two workloads in-process, W1 (64 requests, 280 prompt / 64 output tokens, 16 at
a time) and a mixed-length one (prompts 32..1024, outputs 16..512 tokens, uniform, 16 at a
time), greedy with ``ignore_eos``. After every step it counts the live tokens (slots of device
blocks holding computed KV: ``KVSnapshot.live_tokens``) and what each scheme reserves for the
running requests: paged, the blocks in use x ``block_size``; contiguous, ``max_model_len`` slots
per running request (what a server that pre-allocates a request's whole context reserves).
Utilisation = live / reserved, summed over the steps (a token-step average). ``--plot DIR``
writes ``kv_utilisation.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

WORKLOADS = {
    "W1": {"num_requests": 64, "input": (280, 280), "output": (64, 64)},
    "mixed": {"num_requests": 32, "input": (32, 1024), "output": (16, 512)},
}


def measure(core: Any, name: str, spec: dict[str, Any], seed: int) -> dict[str, Any]:
    from engine.params.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = min(core.token_id_bound, 30000)
    for i in range(spec["num_requests"]):
        n_in = rng.randint(*spec["input"])
        n_out = rng.randint(*spec["output"])
        core.add_request(f"{name}-{i}", [rng.randrange(100, vocab) for _ in range(n_in)],
                         SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True))
    bs, max_len = core.config.block_size, core.max_model_len
    live = paged = contiguous = steps = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        snap = core.kv_snapshot()
        running = len(snap.seqs)
        if not running:
            continue
        steps += 1
        live += snap.live_tokens
        paged += snap.tier("device").used * bs
        contiguous += running * max_len
    return {"workload": name, "num_requests": spec["num_requests"],
            "input_tokens": list(spec["input"]), "output_tokens": list(spec["output"]),
            "steps": steps, "wall_s": round(time.perf_counter() - start, 2),
            "paged": live / paged if paged else 0.0,
            "contiguous": live / contiguous if contiguous else 0.0,
            "mean_live_tokens": live / max(steps, 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.llm import LLM
    from loadgen.serve import machine_info

    overrides: dict[str, Any] = {"max_num_seqs": 16, "enable_prefix_caching": False,
                                 "kv_cache_memory": args.kv_cache_memory}
    if args.max_model_len:
        overrides["max_model_len"] = args.max_model_len
    llm = LLM(args.model, **overrides)
    core = llm.engine
    points = []
    for name in args.workloads:
        spec = dict(WORKLOADS[name])
        if args.num_requests:
            spec["num_requests"] = args.num_requests
        p = measure(core, name, spec, args.seed)
        points.append(p)
        print(f"{name:>6}: live/reserved paged {100 * p['paged']:5.1f}%, contiguous at "
              f"max_model_len {100 * p['contiguous']:5.1f}% ({p['steps']} steps, "
              f"{p['mean_live_tokens']:.0f} live tokens on average)", flush=True)
    result = {"tool": "kvserve bench utilisation", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": machine_info(), "model": core.model_name,
              "block_size": core.config.block_size, "max_model_len": core.max_model_len,
              "max_num_seqs": 16, "points": points}
    llm.close()
    return result


def plot(result: dict[str, Any], out_dir: str) -> str:
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = range(len(pts))
    w = 0.38
    for off, key, label, color in ((-w / 2, "contiguous",
                                     f"contiguous, max_model_len={result['max_model_len']}",
                                     "#c0392b"),
                                    (w / 2, "paged", f"paged, {result['block_size']}-token blocks",
                                     "#2e86c1")):
        vals = [100 * p[key] for p in pts]
        bars = ax.bar([x + off for x in xs], vals, w, label=label, color=color)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v + 1, f"{v:.1f}%", ha="center", fontsize=8)
    ax.axhline(50, color="#888", lw=.8, ls=":")
    ax.axhline(80, color="#888", lw=.8, ls="--")
    ax.set_xticks(list(xs), [p["workload"] for p in pts])
    ax.set_ylim(0, 110)
    ax.set_ylabel("reserved KV slots holding live tokens (%)")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"KV memory utilisation: {result['model']}, {result['date'][:10]}", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "kv_utilisation.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("utilisation", help="live / reserved KV: paged vs contiguous (§3.2)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="model (default: the embedded one)")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["W1", "mixed"])
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the context a contiguous scheme reserves per request (default: the "
                        "model's)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per workload (default: W1 64, mixed 32)")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write kv_utilisation.png into DIR")
    p.set_defaults(func=main_from_args)


def main_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.plot:
        print(f"wrote {plot(result, args.plot)}")
    return 0
