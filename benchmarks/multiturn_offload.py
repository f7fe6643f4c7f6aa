"""Multi-turn chat with a device KV pool too small for every conversation: host tier on vs off.

Each of ``--conversations`` chats runs ``--turns`` turns; every turn resends the whole
conversation (system prompt, all earlier turns and replies) plus a new user message, and all
chats send their turn together. The device pool holds only a fraction of the conversations, so
between two turns of one chat the others push its prefix out of the device. With the host tier
off that prefix is recomputed; with it on (``--swap-space`` GiB) it was spilled to host memory
and is loaded back, and preempted requests may be swapped (``--preemption-mode``, default auto). Both engines run in this process on the same token-level workload (greedy,
ignore_eos, so both produce the same tokens); the script prints, per setting, time to first
token (mean, p50, p90) and tokens computed per request, and the off/on ratios.

    python benchmarks/multiturn_offload.py                  # embedded SmolLM2-135M, CPU
    python benchmarks/multiturn_offload.py --tiny           # a tiny random Llama, seconds
    python benchmarks/multiturn_offload.py --conversations 8 --turns 5 --device-tokens 1024
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.config.kv_disk import WRITE_POLICIES  # noqa: E402
from engine.loading.loader import load_config, resolve_model  # noqa: E402
from engine.models.arch import ModelArch  # noqa: E402
from engine.runner.device import resolve_device  # noqa: E402
from engine.runner.dtype_choice import resolve_dtype  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or GGUF (default: embedded)")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random Llama instead")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    ap.add_argument("--device-tokens", type=int, default=None,
                    help="device KV pool size in tokens (default: a third of the final "
                         "contexts of all conversations, at least one whole conversation)")
    ap.add_argument("--swap-space", type=float, default=1.0, help="host tier in GiB (on run)")
    ap.add_argument("--preemption-mode", default="auto", choices=["recompute", "swap", "auto"],
                    help="preemption of the on run (the off run can only recompute)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disk", action="store_true",
                    help="also run host tier + disk tier (--kv-disk-dir in a temporary "
                         "directory) and print its throughput against the host tier alone")
    ap.add_argument("--kv-disk-size", default="4GiB")
    ap.add_argument("--kv-disk-write-policy", default="write-through",
                    choices=WRITE_POLICIES)
    return ap.parse_args(argv)


def _run(args, model, vocab_hi: int, swap_space: float, device_tokens: int, label: str,
         disk: str | None = None):
    extra = {"kv_disk_dir": disk, "kv_disk_size": args.kv_disk_size,
             "kv_disk_write_policy": args.kv_disk_write_policy} if disk else {}
    llm = LLM(model, dtype=args.dtype, block_size=args.block_size, swap_space=swap_space,
              kv_cache_memory=device_tokens * _bytes_per_token(model, args), seed=args.seed,
              preemption_mode=args.preemption_mode if swap_space else "recompute", **extra)
    rng = random.Random(args.seed)  # the same workload for both runs
    history = [[rng.randrange(10, vocab_hi) for _ in range(args.system_tokens)]
               for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ttft, computed, cached = [], [], []
    replies = []
    t0 = time.perf_counter()
    bar = tqdm(total=args.turns * args.conversations, desc=label, unit="req")
    for _ in range(args.turns):
        prompts = [h + [rng.randrange(10, vocab_hi) for _ in range(args.user_tokens)]
                   for h in history]
        before = llm.stats()["computed_tokens"]
        outs = llm.generate(prompts, params)
        spent = llm.stats()["computed_tokens"] - before
        for i, out in enumerate(outs):
            m = out.metrics
            ttft.append(m.first_token_time - m.arrival_time)
            cached.append(out.num_cached_tokens)
            history[i] = prompts[i] + out.outputs[0].token_ids
            replies.append(out.outputs[0].token_ids)
        computed.extend([spent / len(outs)] * len(outs))
        bar.update(len(outs))
    bar.close()
    wall = time.perf_counter() - t0
    stats = llm.stats()
    llm.engine.kv.check_integrity()
    llm.close()
    return dict(ttft=ttft, computed=computed, cached=cached, wall=wall, stats=stats,
                replies=replies, num_blocks=stats["num_blocks_total"])


def _bytes_per_token(model, args) -> int:
    """KV bytes per token of ``model`` at the dtype the engine will pick (sizes the pool)."""
    arch = ModelArch.from_hf_config(load_config(resolve_model(model)))
    dtype = resolve_dtype(args.dtype, resolve_device("auto"))
    return arch.kv_bytes_per_token(torch.finfo(dtype).bits // 8)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model
    if args.tiny:
        from engine.loading.tiny import make_tiny_model_dir

        model = str(make_tiny_model_dir(Path(tempfile.mkdtemp()) / "tiny", "llama",
                                        max_position_embeddings=4096))
        vocab_hi = 256
    else:
        vocab_hi = 20000
    final = args.system_tokens + args.turns * (args.user_tokens + args.max_tokens)
    device_tokens = args.device_tokens or max(final + args.block_size,
                                              args.conversations * final // 3)
    print(f"{args.conversations} conversations x {args.turns} turns; final context {final} "
          f"tokens each ({args.conversations * final} in all); device pool {device_tokens} "
          f"tokens; host tier {args.swap_space} GiB")
    off = _run(args, model, vocab_hi, 0.0, device_tokens, "host tier off")
    on = _run(args, model, vocab_hi, args.swap_space, device_tokens, "host tier on ")
    same = off["replies"] == on["replies"]
    print(f"\n{'':24}{'off':>12}{'on':>12}{'off/on':>10}")
    rows = [("TTFT mean (s)", statistics.mean(off["ttft"]), statistics.mean(on["ttft"])),
            ("TTFT p50 (s)", _pct(off["ttft"], 0.5), _pct(on["ttft"], 0.5)),
            ("TTFT p90 (s)", _pct(off["ttft"], 0.9), _pct(on["ttft"], 0.9)),
            ("tokens computed / req", statistics.mean(off["computed"]),
             statistics.mean(on["computed"])),
            ("cached tokens / req", statistics.mean(off["cached"]), statistics.mean(on["cached"])),
            ("wall time (s)", off["wall"], on["wall"])]
    for name, a, b in rows:
        ratio = f"{a / b:10.2f}" if b else f"{'-':>10}"
        print(f"{name:24}{a:12.3f}{b:12.3f}{ratio}")
    s = on["stats"]
    print(f"\nhost tier: {s['prefix_cache_host_hits']} prompt tokens loaded back, "
          f"{s['offload_blocks_d2h']} blocks out / {s['offload_blocks_h2d']} in "
          f"({s['offload_bytes_d2h'] / 2**20:.1f} / {s['offload_bytes_h2d'] / 2**20:.1f} MiB), "
          f"{s['host_evictions']} host evictions, preemptions swap/recompute "
          f"{s['num_preemptions_swap']}/{s['num_preemptions_recompute']} "
          f"(off: {off['stats']['num_preemptions']})")
    if args.disk:
        disk = _run(args, model, vocab_hi, args.swap_space, device_tokens, "host + disk   ",
                    disk=tempfile.mkdtemp(prefix="kvdisk-"))
        same = same and disk["replies"] == on["replies"]
        n_gen = len(disk["replies"]) * args.max_tokens
        d = disk["stats"]
        print(f"\ndisk tier: {d['disk_hit_tokens']} prompt tokens read back, "
              f"{d['disk_written_blocks']} blocks written, {d['disk_dropped_writes']} dropped; "
              f"TTFT p50 {_pct(disk['ttft'], 0.5):.3f} s (host alone {_pct(on['ttft'], 0.5):.3f}), "
              f"cached tokens / req {statistics.mean(disk['cached']):.1f} "
              f"(host alone {statistics.mean(on['cached']):.1f})")
        print(f"throughput (requests/s): host tier alone {len(on['replies']) / on['wall']:.3f}, "
              f"host + disk {len(disk['replies']) / disk['wall']:.3f}: "
              f"{on['wall'] / disk['wall']:.2f}x ({n_gen} tokens generated each)")
    print(f"outputs identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
