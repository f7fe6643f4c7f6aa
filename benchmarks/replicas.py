"""Replicas behind a router (issue 58, docs/scale-out.md): ``kvserve serve`` x 3 with small KV
pools on loopback, a pip-installed router in front (sglang-router, vllm-router), one shared-prefix
workload under each routing policy, with and without a shared Redis KV tier.

    python benchmarks/replicas.py                   # embedded SmolLM2-135M: tens of minutes
    python benchmarks/replicas.py --tiny            # a tiny random Llama: a quick run
    python benchmarks/replicas.py --out docs/perf/2026-12-06_spr_replicas

The workload (issue 58): 4 system prompts of ~1,000 tokens (``--prefix-len``), 64 requests
(request i uses prompt i mod 4, then a short question of its own), at most 4 in flight. Every
replica publishes KV cache events (``--kv-events-config``, a ZMQ port of its own), so
vllm-router's ``kv_aware`` reads them (it finds them on ``GET /kv_event_sources``). Before each
policy the replicas' prefix caches (every tier, Redis included) are dropped
(``POST /reset_prefix_cache``) and a fresh router process starts, so each policy begins cold; the
prompts are the same for every policy. With ``--kv-remote`` phases (default: both), the replicas
are started again with ``--kv-remote-url`` to a ``redis-server`` started here (loopback, no
persistence, ``allkeys-lru``), and a last run kills that ``redis-server`` after a quarter of the
requests (every request must still succeed: the replicas recompute).

Printed per policy: the prefix hit rate (sum of ``usage.prompt_tokens_details.cached_tokens``
over the sum of prompt tokens), the placement hits (requests whose replica held their system
prompt: the response reports at least ``--hit-share`` of the prefix cached; with Redis, the
replicas' ``kvserve:remote_kv_cache_blocks{result="hit"}`` counters say how many of those
prefixes came from Redis rather than the replica's own pools), requests/s, TTFT p50, failed
requests, and each figure's ratio to round-robin in the same phase. ``--json`` keeps every
number; ``--out DIR`` writes the printed table, the JSON and the replica and router logs there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import running_server, start_redis  # noqa: E402
from loadgen.client import BenchClient, ClientConfig  # noqa: E402
from loadgen.serve import free_port, machine_info, run_point  # noqa: E402
from loadgen.stats import summarize  # noqa: E402
from loadgen.workloads import WorkloadConfig, build_sessions, load_tokenizer  # noqa: E402

# (label, router module, --policy); the first is the baseline the ratios divide by
POLICIES = {
    "round_robin": ("sglang-router round_robin", "sglang_router.launch_router", "round_robin"),
    "sglang-cache_aware": ("sglang-router cache_aware", "sglang_router.launch_router",
                           "cache_aware"),
    "vllm-round_robin": ("vllm-router round_robin", "vllm_router.launch_router", "round_robin"),
    "vllm-cache_aware": ("vllm-router cache_aware", "vllm_router.launch_router", "cache_aware"),
    "kv_aware": ("vllm-router kv_aware", "vllm_router.launch_router", "kv_aware"),
}
DEFAULT_POLICIES = ["round_robin", "sglang-cache_aware", "vllm-cache_aware", "kv_aware"]
REMOTE_HITS = re.compile(r'^kvserve:remote_kv_cache_blocks(?:_total)?\{[^}]*"hit"[^}]*\}\s+(\S+)',
                         re.M)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or GGUF (default: embedded)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (a quick run)")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default=None,
                    help="each replica's KV pool (default: 48MiB; --tiny: 240KiB), small enough "
                    "that one replica cannot hold every system prompt")
    ap.add_argument("--threads", type=int, default=1,
                    help="--num-threads of each replica (default 1: 3 replicas share the cores)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="each replica's prefill chunk (tokens per step; default 256): a "
                    "replica announces a prompt's blocks chunk by chunk, so kv_aware sees a "
                    "prefix being computed within one chunk's time")
    ap.add_argument("--swap-space", default=None,
                    help="each replica's --swap-space (host tier, GiB); 0 keeps the Redis phase "
                    "from being a host-tier phase (a stored tier brings a host tier)")
    ap.add_argument("--prefix-len", type=int, default=None,
                    help="system prompt tokens (default 1000; --tiny: 200)")
    ap.add_argument("--num-groups", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--suffix-len", type=int, default=16, help="each request's own tokens")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES, choices=list(POLICIES),
                    help="the first is the baseline of the ratios")
    ap.add_argument("--kv-remote", choices=("both", "off", "on"), default="both",
                    help="phases without and/or with the shared Redis tier")
    ap.add_argument("--no-kill", action="store_true",
                    help="skip the run that kills redis-server mid-run")
    ap.add_argument("--hit-share", type=float, default=0.9,
                    help="a placement hit: at least this share of the prefix reported cached")
    ap.add_argument("--router-args", default="",
                    help="more arguments for every router, e.g. '--log-level debug'")
    ap.add_argument("--seed", type=int, default=58)
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--out", default=None, help="a folder for the table, JSON and logs")
    return ap.parse_args(argv)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_router(module: str, policy: str, workers: list[str], log: Path, model: str,
                   extra: tuple[str, ...] = ()):
    """``python -m MODULE`` on a free loopback port; yields its URL once its ``/v1/models``
    lists ``model`` (the replicas were discovered); SIGTERM on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), "--worker-urls", *workers, "--policy", policy,
           *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{module} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{url}/v1/models", timeout=5)
                if r.status_code == 200 and model in [m.get("id") for m in
                                                      r.json().get("data", [])]:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{module} not ready after 120 s; see {log}")
            time.sleep(0.5)
        if policy == "kv_aware":  # the subscribers connect after discovery: let them join
            time.sleep(2.0)
        yield url
    finally:
        _stop(proc)


def remote_hit_blocks(replicas: list[str]) -> float:
    total = 0.0
    for url in replicas:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        total += sum(float(v) for v in REMOTE_HITS.findall(text))
    return total


def reset_replicas(replicas: list[str]) -> None:
    for url in replicas:
        r = httpx.post(f"{url}/reset_prefix_cache", timeout=120)
        r.raise_for_status()


async def _workload(url: str, model: str, sessions: list, args: argparse.Namespace,
                    kill: Any = None) -> tuple[list, float]:
    cfg = ClientConfig(url, model, None, False, args.timeout)
    async with BenchClient(cfg) as client:
        if kill is None:
            return await run_point(client, sessions, [0.0] * len(sessions), args.concurrency)

        class Progress:  # kills redis-server once a quarter of the requests finished
            done = 0

            def update(self, n: int) -> None:
                self.done += n
                if self.done == max(1, len(sessions) // 4):
                    kill()

        return await run_point(client, sessions, [0.0] * len(sessions), args.concurrency,
                               Progress())


def run_policy(key: str, replicas: list[str], sessions: list, args: argparse.Namespace,
               logs: Path, phase: str, prefix_tokens: int, block: int, kill: Any = None
               ) -> dict[str, Any]:
    label, module, policy = POLICIES[key]
    reset_replicas(replicas)
    before = remote_hit_blocks(replicas)
    log = logs / f"router-{phase}-{key}{'-kill' if kill else ''}.log"
    with running_router(module, policy, replicas, log, args.served_name,
                        tuple(args.router_args.split())) as url:
        records, wall = asyncio.run(_workload(url, args.served_name, sessions, args, kill))
    after = remote_hit_blocks(replicas) if kill is None else None
    s = summarize(records, wall, label, {"policy": key, "phase": phase})
    ok = [r for r in records if r.ok]
    need = args.hit_share * prefix_tokens
    hits = sum(1 for r in ok if (r.cached_tokens or 0) >= need)
    prefix_blocks = max(1, prefix_tokens // block)
    from_redis = None if after is None else (after - before) / prefix_blocks
    return {"key": key, "label": label, "phase": phase, "killed_redis": kill is not None,
            "requests": len(records), "failed": s.failed, "errors": s.errors,
            "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
            "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "placement_hits": hits,
            "prefixes_from_redis": from_redis,
            "requests_per_s": s.request_throughput, "wall_s": wall,
            "ttft_p50_s": s.ttft_ms.p50 / 1000 if s.ttft_ms.n else None,
            # request i (system prompt i mod num_groups), in order: cached tokens, TTFT
            "per_request": [[r.cached_tokens, None if r.ttft is None else round(r.ttft, 3)]
                            for r in records]}


def format_phase(rows: list[dict[str, Any]], n: int) -> str:
    base = rows[0]
    out = [f"{'policy':<28}{'hit rate':>9}{'x rr':>7}{'placed':>9}{'from Redis':>11}"
           f"{'req/s':>8}{'x rr':>7}{'TTFT p50 s':>11}{'x rr':>7}{'failed':>7}"]
    for r in rows:
        def ratio(k: str, row: dict[str, Any] = r) -> str:
            return (f"{row[k] / base[k]:7.2f}" if row[k] and base[k] else f"{'-':>7}")
        redis = ("-" if r["prefixes_from_redis"] is None else
                 f"~{r['prefixes_from_redis']:.0f}")
        name = r["label"] + (" (redis killed)" if r["killed_redis"] else "")
        ttft = f"{r['ttft_p50_s']:11.2f}" if r["ttft_p50_s"] is not None else f"{'-':>11}"
        out.append(f"{name:<28}{r['hit_rate']:9.3f}{ratio('hit_rate')}"
                   f"{r['placement_hits']:>6}/{n:<2}{redis:>11}{r['requests_per_s']:8.3f}"
                   f"{ratio('requests_per_s')}{ttft}{ratio('ttft_p50_s')}{r['failed']:>7}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-replicas-"))
    out = Path(args.out) if args.out else None
    logs = out / "logs" if out else tmp
    logs.mkdir(parents=True, exist_ok=True)
    model = args.model
    extra: list[str] = []
    if args.tiny:
        from engine.loading.tiny import make_tiny_model_dir

        model = str(make_tiny_model_dir(tmp / "tiny", "llama", max_position_embeddings=2048))
        extra = ["--dtype", "float32", "--block-size", "16"]
    args.prefix_len = args.prefix_len or (200 if args.tiny else 1000)
    pool = args.kv_cache_memory or ("240KiB" if args.tiny else "48MiB")
    args.served_name = "tiny" if args.tiny else "smollm2-135m"
    tokenizer = load_tokenizer(model)
    sessions_cfg = WorkloadConfig(kind="shared-prefix", num_requests=args.num_requests,
                                  input_len=args.suffix_len, output_len=args.output_len,
                                  prefix_len=args.prefix_len, num_groups=args.num_groups,
                                  range_ratio=0.0, seed=args.seed)
    prefix_tokens = len(tokenizer.encode(build_sessions(sessions_cfg, tokenizer)[0]
                                         .turns[0].prompt.text)) - args.suffix_len \
        if tokenizer is not None else args.prefix_len
    block = 16
    phases = {"both": ["off", "on"], "off": ["off"], "on": ["on"]}[args.kv_remote]
    header = (f"model {model or 'embedded SmolLM2-135M-Instruct'} | {args.replicas} replicas, "
              f"KV pool {pool} each, --num-threads {args.threads}, --max-num-batched-tokens "
              f"{args.max_num_batched_tokens} | {args.num_groups} system "
              f"prompts of ~{args.prefix_len} tokens, {args.num_requests} requests of "
              f"+{args.suffix_len} tokens, {args.output_len} generated, concurrency "
              f"{args.concurrency} | {machine_info()['cpu']}, {machine_info()['cores']} cores")
    print(header, flush=True)
    result: dict[str, Any] = {"tool": "benchmarks/replicas.py", "argv": sys.argv[1:],
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "machine": machine_info(), "header": header, "phases": {}}
    tables = [header]
    for phase in phases:
        redis_proc = None
        phase_extra = list(extra)
        if phase == "on":
            redis_proc, host, port = start_redis(tmp)
            phase_extra += ["--kv-remote-url", f"redis://{host}:{port}/0"]
        rows: list[dict[str, Any]] = []
        try:
            with contextlib.ExitStack() as stack:
                replicas = []
                for i in range(args.replicas):
                    events = json.dumps({"enable_kv_cache_events": True,
                                         "endpoint": f"tcp://*:{free_port()}"})
                    cmd = ([model] if model else []) + [
                        "--served-model-name", args.served_name, "--kv-cache-memory", pool,
                        "--num-threads", str(args.threads), "--kv-events-config", events,
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                        *(["--swap-space", str(args.swap_space)] if args.swap_space else []),
                        *phase_extra]
                    replicas.append(stack.enter_context(running_server(
                        cmd, logs / f"replica{i}-remote-{phase}.log")))
                for url in replicas:  # warm every replica once (not through a router)
                    httpx.post(f"{url}/v1/completions", timeout=600, json={
                        "model": args.served_name, "prompt": "Hello there, how are you",
                        "max_tokens": 4, "temperature": 0}).raise_for_status()
                sessions = build_sessions(sessions_cfg, tokenizer)
                for key in args.policies:
                    print(f"[redis {phase}] {POLICIES[key][0]} ...", flush=True)
                    rows.append(run_policy(key, replicas, sessions, args, logs, phase,
                                           prefix_tokens, block))
                    print(format_phase(rows, args.num_requests).splitlines()[-1], flush=True)
                if phase == "on" and not args.no_kill and redis_proc is not None:
                    proc = redis_proc

                    def kill(proc: subprocess.Popen = proc) -> None:
                        print("  killing redis-server", flush=True)
                        proc.kill()

                    key = args.policies[-1]
                    print(f"[redis {phase}] {POLICIES[key][0]}, redis-server killed after "
                          f"{args.num_requests // 4} requests ...", flush=True)
                    rows.append(run_policy(key, replicas, sessions, args, logs, phase,
                                           prefix_tokens, block, kill=kill))
                    print(format_phase(rows, args.num_requests).splitlines()[-1], flush=True)
        finally:
            if redis_proc is not None and redis_proc.poll() is None:
                redis_proc.kill()
            if redis_proc is not None:
                redis_proc.wait()
        table = (f"\n== shared Redis tier {phase} (ratios: to {rows[0]['label']} in this phase) "
                 f"==\n{format_phase(rows, args.num_requests)}")
        print(table, flush=True)
        tables.append(table)
        result["phases"][phase] = rows
    if args.json or out:
        text = json.dumps(result, indent=2)
        Path(args.json or out / "replicas.json").write_text(text + "\n")
    if out:
        (out / "replicas.txt").write_text("\n".join(tables) + "\n")
    if not out:
        shutil.rmtree(tmp, ignore_errors=True)
    failed = sum(r["failed"] for rows in result["phases"].values() for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
