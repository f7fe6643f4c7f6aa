"""``kvserve bench profile``: a short workload under torch.profiler, and the seed's §5.2 table.

    kvserve bench profile [MODEL] [--num-requests 8] [--input-len 256] [--output-len 64]

The engine runs in-process (offline), profiled in two windows (the prefill steps, then the
decode steps), the model's parts marked by ``record_function`` ranges for this run only:
``attention``, ``linear`` (every projection and the LM head), ``sampling``; per window each
part's share of the step time, and ``other`` for the rest (norms, rotary, embedding, the
scheduler, Python). The fused CPU decode stack is turned off for this run
(``KVSERVE_DECODE_STACK=0``: it hides the layers from the profiler). With CUDA the time is the
host's; the trace (``--trace-dir``) has the device's. Then the KV memory growth over the decode
window, measured (blocks in use x bytes per block) next to the formula
``2 x layers x kv_heads x head_dim x sizeof(dtype) x tokens`` summed over the live sequences."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

from engine import envs

PARTS = ("attention", "linear", "sampling")


def _wrap(obj: Any, name: str, label: str) -> None:
    import torch

    inner = getattr(obj, name)

    def wrapped(*a: Any, **k: Any) -> Any:
        with torch.profiler.record_function(label):
            return inner(*a, **k)

    setattr(obj, name, wrapped)


def instrument(core: Any) -> None:
    """Mark attention, linears and sampling of ``core`` with ``kvserve::<part>`` ranges."""
    from torch import nn

    runner = core.runner
    _wrap(runner.backend, "forward", "kvserve::attention")
    model = runner.model
    wrapped: list[str] = []
    for name, mod in model.named_modules():
        if name in ("lm_head", "tied_head") or any(name.startswith(w + ".") for w in wrapped):
            continue  # the LM head is counted by compute_logits; nested: counted outside
        if isinstance(mod, nn.Linear) or type(mod).__name__ in ("QuantLinear", "PackedLinear",
                                                               "QuantConcat"):
            _wrap(mod, "forward", "kvserve::linear")
            wrapped.append(name)
    _wrap(model, "compute_logits", "kvserve::linear")
    sampler = core.sampler

    class _Timed:
        def __getattr__(self, item: str) -> Any:
            return getattr(sampler, item)

        def __call__(self, *a: Any, **k: Any) -> Any:
            import torch

            with torch.profiler.record_function("kvserve::sampling"):
                return sampler(*a, **k)

    core.sampler = _Timed()


def _ranges(prof: Any) -> dict[str, float]:
    """Inclusive CPU microseconds per ``kvserve::`` range."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith("kvserve::"):
            out[e.key.removeprefix("kvserve::")] = float(e.cpu_time_total)
    return out


def _window(core: Any, until: Any, trace_dir: str | None, tag: str) -> dict[str, Any]:
    import torch

    from engine.profiling import profiler_activities

    steps = 0
    start = time.perf_counter()
    with torch.profiler.profile(activities=profiler_activities(), record_shapes=False) as prof:
        while core.has_unfinished_requests() and not until():
            with torch.profiler.record_function("kvserve::step"):
                core.step()
            steps += 1
    wall = time.perf_counter() - start
    r = _ranges(prof)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace_dir, f"kvserve-profile-{tag}.json"))
    total = r.get("step", 0.0)
    shares = {p: r.get(p, 0.0) / total if total else 0.0 for p in PARTS}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return {"steps": steps, "wall_s": wall, "step_ms": total / 1000 / max(steps, 1),
            "shares": shares}


def run(args: argparse.Namespace) -> dict[str, Any]:
    envs.set_default(envs.DECODE_STACK, "0")
    import random

    from engine.llm import LLM
    from engine.params.sampling import SamplingParams

    overrides: dict[str, Any] = {"kv_cache_memory": args.kv_cache_memory}
    if args.dtype:
        overrides["dtype"] = args.dtype
    llm = LLM(args.model, **overrides)
    core = llm.engine
    instrument(core)
    rng = random.Random(0)
    vocab = min(core.token_id_bound, 30000)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # warm-up (kernels, allocator), not profiled
    core.add_request("warm", [rng.randrange(100, vocab) for _ in range(16)],
                     SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while core.has_unfinished_requests():
        core.step()
    reqs = []
    for i in range(args.num_requests):
        ids = [rng.randrange(100, vocab) for _ in range(args.input_len)]
        core.add_request(f"p{i}", ids, params)
        reqs.append(core.requests[f"p{i}"])

    def all_started() -> bool:
        return all(len(s.token_ids) > s.num_prompt_tokens for r in reqs for s in r.seqs)

    prefill = _window(core, all_started, args.trace_dir, "prefill")
    geometry = core.kv_snapshots.geometry
    block_bytes = geometry.bytes_per_block
    growth = []

    def sample_growth() -> bool:
        seqs = [s for r in reqs for s in r.seqs if not s.finished]
        tokens = sum(s.num_computed_tokens for s in seqs)
        used = core.kv.stats().num_used_blocks
        growth.append({"live_tokens": tokens, "blocks_used": used,
                       "measured_bytes": used * block_bytes,
                       "formula_bytes": geometry.bytes_per_token * tokens})
        return False

    sample_growth()
    decode = _window(core, sample_growth, args.trace_dir, "decode")
    llm.close()
    return {"tool": "kvserve bench profile", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": core.model_name, "device": str(core.runner.device),
            "kv_cache_dtype": geometry.kv_cache_dtype,
            "workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                         "output_len": args.output_len},
            "decode_stack": envs.get(envs.DECODE_STACK),
            "prefill": prefill, "decode": decode,
            "kv_formula": (f"2 x {geometry.num_layers} layers x {geometry.num_kv_heads} kv heads "
                           f"x {geometry.row_bytes} bytes = {geometry.bytes_per_token} B/token"),
            "kv_growth": growth}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"§5.2 time share per step ({result['model']}, {result['device']}, "
             f"{result['workload']['num_requests']} requests x {result['workload']['input_len']}"
             f" in / {result['workload']['output_len']} out)",
             f"{'phase':<9}{'steps':>6}{'ms/step':>10}" + "".join(f"{p:>11}" for p in PARTS)
             + f"{'other':>11}"]
    for phase in ("prefill", "decode"):
        w = result[phase]
        lines.append(f"{phase:<9}{w['steps']:>6}{w['step_ms']:>10.2f}" + "".join(
            f"{100 * w['shares'][p]:>10.1f}%" for p in (*PARTS, "other")))
    lines.append("")
    lines.append(f"KV memory growth while decoding ({result['kv_formula']})")
    lines.append(f"{'live tokens':>12}{'blocks':>8}{'measured':>14}{'formula':>14}{'ratio':>8}")
    g = result["kv_growth"]
    picks = sorted({0, len(g) // 4, len(g) // 2, 3 * len(g) // 4, len(g) - 1}) if g else []
    for i in picks:
        x = g[i]
        ratio = x["measured_bytes"] / x["formula_bytes"] if x["formula_bytes"] else 0.0
        lines.append(f"{x['live_tokens']:>12}{x['blocks_used']:>8}{x['measured_bytes']:>14,}"
                     f"{x['formula_bytes']:>14,}{ratio:>8.3f}")
    lines.append("(measured: blocks in use x bytes per block; above the formula by the unfilled "
                 "slots of each sequence's last block)")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="profile a short workload: §5.2 time shares, KV growth",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="model (default: the embedded one)")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: auto)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--trace-dir", default=None,
                   help="also write the two windows' Chrome/Perfetto traces here")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.set_defaults(func=main_from_args)


def main_from_args(args: argparse.Namespace) -> int:
    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            print(f"kvserve: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    result = run(args)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0
