"""``kvserve bench kv-onoff``: generation with and without the KV cache (the seed's §2.3 claim).

    kvserve bench kv-onoff [MODEL] [--output-lens 64,128,256,512,1024] [--prompt-len 32]
                           [--json PATH] [--plot DIR]

One sequence, greedy, exactly N new tokens for each N of ``--output-lens``, four ways on the
same weights: HF transformers ``generate`` with ``use_cache=True`` and ``use_cache=False``
(every token recomputes the whole prefix), and kvserve's engine decoding normally and
re-prefilling (``server/loadgen/baselines.py``: ``max_tokens=1`` on the whole sequence so far, with
prefix caching off). Prints tokens/s of each and the cache-on/off ratio per system, which grows
with N: without a cache step t costs O(t) tokens of compute, so N tokens cost O(N^2). The token
ids of on and off are compared (greedy: they should agree; float reductions of different shapes
may flip a near-tie). ``--plot DIR`` writes ``kv_onoff.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.llm import LLM
    from engine.params.sampling import SamplingParams
    from loadgen import baselines
    from loadgen.serve import machine_info

    overrides: dict[str, Any] = {"enable_prefix_caching": False}
    if args.dtype:
        overrides["dtype"] = args.dtype
    llm = LLM(args.model, **overrides)
    core = llm.engine
    rng = random.Random(args.seed)
    vocab = min(core.token_id_bound, 30000)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
    systems = {s.strip() for s in args.systems.split(",")}
    hf = None
    if "hf" in systems:
        hf = baselines.load_hf_model(str(core.files.path), core.runner.dtype)
        with torch.inference_mode():  # warm-up
            hf.generate(torch.tensor([prompt[:8]]), max_new_tokens=2, do_sample=False,
                        pad_token_id=0)
    llm.generate([prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    points = []
    for n in args.output_lens:
        point: dict[str, Any] = {"output_len": n}
        if "kvserve" in systems:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            on = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            wall_on = time.perf_counter() - t
            off = baselines.recompute_generate(llm, [prompt], n)
            point["kvserve"] = {"on_tok_s": n / wall_on, "off_tok_s": n / off.wall_s,
                                "ratio": off.wall_s / wall_on,
                                "match": baselines.match_fraction([list(on)], off.token_ids)}
        if hf is not None:
            res = {}
            ids = {}
            for use_cache in (True, False):
                t = time.perf_counter()
                with torch.inference_mode():
                    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, use_cache=use_cache, pad_token_id=0)
                res[use_cache] = time.perf_counter() - t
                ids[use_cache] = out[0, len(prompt):].tolist()
            point["hf"] = {"on_tok_s": n / res[True], "off_tok_s": n / res[False],
                           "ratio": res[False] / res[True],
                           "match": baselines.match_fraction([ids[True]], [ids[False]])}
        points.append(point)
        print(format_point(point), flush=True)
    llm.close()
    return {"tool": "kvserve bench kv-onoff", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_info(), "model": core.model_name,
            "dtype": str(core.runner.dtype).removeprefix("torch."),
            "threads": core.config.resolved_num_threads(), "prompt_len": args.prompt_len,
            "points": points}


def format_point(p: dict[str, Any]) -> str:
    parts = [f"N={p['output_len']:>5}"]
    for name in ("kvserve", "hf"):
        if name in p:
            x = p[name]
            parts.append(f"{name}: on {x['on_tok_s']:8.1f} tok/s, off {x['off_tok_s']:8.1f} "
                         f"tok/s, x{x['ratio']:6.2f} (tokens agree {100 * x['match']:.0f}%)")
    return " | ".join(parts)


def plot(result: dict[str, Any], out_dir: str) -> str:
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    xs = [p["output_len"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("kvserve", "-"), ("hf", "--")):
        if name not in pts[0]:
            continue
        label = "kvserve" if name == "kvserve" else "HF transformers"
        a.plot(xs, [p[name]["on_tok_s"] for p in pts], style + "o", label=f"{label}, cache on")
        a.plot(xs, [p[name]["off_tok_s"] for p in pts], style + "x", label=f"{label}, cache off")
        b.plot(xs, [p[name]["ratio"] for p in pts], style + "o", label=label)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("output tokens")
        ax.grid(alpha=.3)
        ax.legend(fontsize=8)
    a.set_ylabel("tokens/s (one sequence)")
    a.set_yscale("log")
    b.set_ylabel("speed-up of the KV cache (x)")
    m = result["machine"]
    fig.suptitle(f"KV cache on vs off: {result['model']} ({result['dtype']}), "
                 f"{m['cpu']}, {result['threads']} threads, {result['date'][:10]}", fontsize=9)
    fig.tight_layout()
    path = Path(out_dir) / "kv_onoff.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got "
                                         f"{text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected positive integers")
    return values


def add_parser(sub: Any) -> None:
    p = sub.add_parser("kv-onoff", help="tokens/s with and without the KV cache (§2.3)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="model (default: the embedded one)")
    p.add_argument("--output-lens", type=_ints, default=[64, 128, 256, 512, 1024])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--systems", default="kvserve,hf", help="kvserve, hf or both (default)")
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="DIR", help="write kv_onoff.png into DIR")
    p.set_defaults(func=main_from_args)


def main_from_args(args: argparse.Namespace) -> int:
    if args.prompt_len < 1:
        print("kvserve: error: --prompt-len must be >= 1", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.plot:
        print(f"wrote {plot(result, args.plot)}")
    return 0
