"""``kvserve bench serve``: load-test an OpenAI-compatible server and report what users feel.

A run is a sweep over the points asked for (prefix lengths x output lengths x concurrencies x
request rates); each point sends exactly ``num_requests`` requests (bounded: no retries, every
request has a timeout) and yields a ``RunSummary``. Sessions start at their arrival time (all at
once, or a Poisson process); ``concurrency`` caps the requests in flight. A multi-turn session
sends its turns one after another, each resending the conversation with the previous answers;
an agent session (workload ``agent``) sends its tools with every turn and appends each turn's
scripted messages (a tool call and its result) instead of the model's answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadgen.client import BenchClient, ClientConfig
from loadgen.stats import RequestRecord, RunSummary, format_summary, summarize
from loadgen.workloads import (
    Session,
    WorkloadConfig,
    build_sessions,
    derive_seed,
    load_tokenizer,
    poisson_arrivals,
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server to start on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Point:
    """One point of a sweep."""

    workload: WorkloadConfig
    concurrency: int | None
    request_rate: float | None

    def params(self) -> dict[str, Any]:
        w = self.workload
        return {"workload": w.kind, "num_requests": w.num_requests, "input_len": w.input_len,
                "output_len": w.output_len, "prefix_len": w.prefix_len if w.kind ==
                "shared-prefix" else 0, "num_groups": w.num_groups, "num_turns": w.num_turns,
                "range_ratio": w.range_ratio, "concurrency": self.concurrency,
                "request_rate": self.request_rate, "seed": w.seed} | (
                    {"tools_len": w.tools_len, "tool_result_len": w.tool_result_len,
                     "tool_choice": w.tool_choice} if w.kind == "agent" else {})


async def run_point(client: BenchClient, sessions: list[Session], arrivals: list[float],
                    concurrency: int | None, progress: Any = None) -> tuple[list[RequestRecord],
                                                                           float]:
    """Send every turn of every session; returns the records and the wall time of the run."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1; got {concurrency}")
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    async def one(session: Session, arrival: float) -> list[RequestRecord]:
        delay = arrival - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        records: list[RequestRecord] = []
        messages: list[dict[str, Any]] = []
        for i, turn in enumerate(session.turns):
            if records and not records[-1].ok:
                # A conversation cannot continue past a failed answer; count the rest as failed.
                now = time.perf_counter()
                records.extend(RequestRecord(ok=False, start=now, end=now, max_tokens=t.max_tokens,
                                             error="skipped: an earlier turn failed")
                               for t in session.turns[i:])
                if progress is not None:
                    progress.update(len(session.turns) - i)
                break
            if sem is not None:
                await sem.acquire()
            try:
                if session.tools is not None:
                    messages.extend(turn.messages or ())
                    expected = session.tools_tokens + sum(t.prompt.num_tokens
                                                          for t in session.turns[:i + 1])
                    rec = await client.chat(messages, turn.max_tokens, expected,
                                            tools=session.tools,
                                            tool_choice=session.tool_choice)
                elif session.chat:
                    messages.append({"role": "user", "content": turn.prompt.text})
                    expected = sum(t.prompt.num_tokens + t.max_tokens
                                   for t in session.turns[:i]) + turn.prompt.num_tokens
                    rec = await client.chat(messages, turn.max_tokens, expected)
                    messages.append({"role": "assistant", "content": rec.text})
                else:
                    prompt = turn.prompt.text
                    if client.cfg.prompt_token_ids:
                        prompt = turn.prompt.token_ids
                    rec = await client.complete(prompt, turn.max_tokens, turn.prompt.num_tokens)
            finally:
                if sem is not None:
                    sem.release()
            if session.chat:
                rec.turn = i
            records.append(rec)
            if progress is not None:
                progress.update(1)
        return records

    results = await asyncio.gather(*(one(s, a) for s, a in zip(sessions, arrivals, strict=True)))
    return [r for rs in results for r in rs], time.perf_counter() - t0


def build_points(args: argparse.Namespace) -> list[Point]:
    prefixes = args.prefix_len if args.workload == "shared-prefix" else [0]
    points = []
    for prefix in prefixes:
        for out_len in args.output_len:
            for conc in args.concurrency or [None]:
                for rate in args.request_rate or [None]:
                    # A fresh seed per point: a later point must not hit prefixes an earlier
                    # point left in the server's cache.
                    w = WorkloadConfig(kind=args.workload, num_requests=args.num_requests,
                                       input_len=args.input_len, output_len=out_len,
                                       range_ratio=args.range_ratio, prefix_len=prefix,
                                       num_groups=args.num_groups,
                                       num_turns=getattr(args, "num_turns", 1),
                                       seed=derive_seed(args.seed, "point", len(points)),
                                       **_agent_fields(args))
                    points.append(Point(w, conc, rate))
    return points


def _agent_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The agent workload's WorkloadConfig fields that the command line gives (serve only)."""
    return {k: getattr(args, k) for k in ("tools_len", "tool_result_len", "tool_choice")
            if getattr(args, k, None) is not None}


def _yardstick(args: argparse.Namespace, model: str, log: Any) -> tuple[Any, Any]:
    """(model shape, matmul peak) for the efficiency line, or (None, None) with a note why."""
    if args.no_yardstick:
        return None, None
    from loadgen.kv_calc import resolve_shape
    from loadgen.yardstick import measure_matmul_peak

    try:
        shape = resolve_shape(args.model_config or model)
        shape.non_embedding_params()
    except (ValueError, OSError) as e:
        print(f"efficiency not reported ({e}); give --model-config", file=log)
        return None, None
    peak = measure_matmul_peak(shape, dtype=args.peak_dtype)
    print(f"matmul peak: {peak.gflops:.1f} GFLOP/s ({peak.dtype}, {peak.rows}x{peak.shape[0]}x"
          f"{peak.shape[1]}, {peak.threads} threads; probes "
          + ", ".join(f"{k}: {v:.1f}" for k, v in peak.probes.items()) + ")", file=log)
    return shape, peak


def _remeasure(summaries: list[RunSummary], shape: Any, peak: Any, dtype: str, log: Any) -> Any:
    """Probe the peak again after the load; keep the higher and restate the efficiencies."""
    from loadgen.yardstick import best_peak, measure_matmul_peak, rescale

    best = best_peak(peak, measure_matmul_peak(shape, dtype=dtype))
    if best is not peak:
        print(f"matmul peak after the run: {best.gflops:.1f} GFLOP/s (higher than before: "
              f"efficiencies restated against it)", file=log)
        for s in summaries:
            if s.efficiency:
                s.efficiency = rescale(s.efficiency, best)
                print(f"  {_describe_params(s.params)}: efficiency "
                      f"{s.efficiency['efficiency'] * 100:.1f}%", file=log)
    return best


def _describe_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={params[k]}" for k in ("workload", "prefix_len", "output_len",
                                                  "concurrency", "request_rate")
                     if params.get(k) not in (None, 0))


def add_efficiency(summary: RunSummary, records: list[RequestRecord], shape: Any,
                   peak: Any) -> None:
    from loadgen.yardstick import efficiency_report, run_flops

    triples = [((r.prompt_tokens if r.prompt_tokens is not None else r.expected_prompt_tokens),
                r.output_tokens, r.cached_tokens or 0) for r in records if r.ok]
    triples = [t for t in triples if t[0] > 0]
    if triples:
        summary.efficiency = efficiency_report(run_flops(shape, triples), summary.duration_s,
                                               peak)


async def _run_all(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from tqdm import tqdm

    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
    tokenizer = load_tokenizer(args.tokenizer)
    ids = getattr(args, "prompt_token_ids", False)
    if ids and (tokenizer is None or args.endpoint == "chat"):
        raise ValueError("--prompt-token-ids needs a tokenizer (not --tokenizer none) and the "
                         "completions endpoint")
    probe = ClientConfig(args.base_url, args.model or "", args.api_key, args.openai_only,
                         args.timeout)
    async with BenchClient(probe) as c:
        model = args.model or (await c.list_models() or [""])[0]
    if not model:
        raise ValueError("the server lists no model; give --model")
    cfg = ClientConfig(args.base_url, model, args.api_key, args.openai_only, args.timeout,
                       ttft_first_chunk=getattr(args, "ttft_at", "token") == "first-chunk",
                       prompt_token_ids=ids)
    label = args.label or f"{model} @ {args.base_url}"
    shape, peak = _yardstick(args, model, log)
    summaries: list[RunSummary] = []
    async with BenchClient(cfg) as client:
        if args.warmup:
            warm = build_sessions(WorkloadConfig(num_requests=args.warmup, input_len=16,
                                                 output_len=4,
                                                 seed=derive_seed(args.seed, "warmup")), tokenizer)
            await run_point(client, warm, [0.0] * len(warm), None)
        for point in build_points(args):
            sessions = build_sessions(point.workload, tokenizer)
            if args.endpoint == "chat":
                for session in sessions:
                    session.chat = True
            arrivals = poisson_arrivals(len(sessions), point.request_rate, point.workload.seed)
            bar = tqdm(total=point.workload.num_requests, file=log, desc=_describe(point),
                       leave=False, disable=True if args.no_progress else None)
            records, duration = await run_point(client, sessions, arrivals, point.concurrency,
                                                bar)
            bar.close()
            summary = summarize(records, duration, label, point.params())
            if shape is not None:
                add_efficiency(summary, records, shape, peak)
            summary.params["usage_matches_stream"] = all(
                r.usage_completion_tokens in (None, r.stream_tokens) for r in records if r.ok)
            summaries.append(summary)
            print(format_summary(summary), file=log)
    if peak is not None:
        peak = _remeasure(summaries, shape, peak, args.peak_dtype, log)
    return {"tool": "kvserve bench serve", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_info(), "base_url": args.base_url, "model": model,
            "openai_only": args.openai_only, "label": label, "seed": args.seed,
            "ttft_at": getattr(args, "ttft_at", "token"), "prompt_token_ids": ids,
            "matmul_peak": None if peak is None else vars(peak) | {"shape": list(peak.shape)},
            "runs": [s.to_dict() for s in summaries]}


def _describe(p: Point) -> str:
    parts = [p.workload.kind]
    if p.workload.kind == "shared-prefix":
        parts.append(f"prefix={p.workload.prefix_len}")
    if p.workload.kind == "agent":
        parts.append(f"tools={p.workload.tools_len} turns={p.workload.num_turns}")
    parts.append(f"out={p.workload.output_len}")
    if p.concurrency:
        parts.append(f"c={p.concurrency}")
    if p.request_rate and not math.isinf(p.request_rate):
        parts.append(f"rate={p.request_rate:g}")
    return " ".join(parts)


def machine_info() -> dict[str, Any]:
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count()
    return {"cpu": cpu, "cores": cores, "platform": platform.platform(),
            "python": platform.python_version()}


def write_outputs(result: dict[str, Any], args: argparse.Namespace) -> None:
    """--json and --plot, shared by bench serve and bench offline."""
    if args.json:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.plot:
        from loadgen.plots import plot_results

        extra = []
        for path in getattr(args, "compare", []) or []:
            with open(path) as f:
                extra.extend(json.load(f).get("runs", []))
        for path in plot_results(result, args.plot, extra_runs=extra):
            print(f"wrote {path}", file=sys.stderr)


def main_from_args(args: argparse.Namespace) -> int:
    """Exit status: 0 when every request succeeded, 1 when some failed, 2 on bad arguments."""
    log = sys.stderr if args.json == "-" else sys.stdout
    try:
        result = asyncio.run(_run_all(args, log))
    except ValueError as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    except (OSError, httpx.HTTPError) as e:
        print(f"bench serve: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 2
    write_outputs(result, args)
    return 1 if any(r["failed"] for r in result["runs"]) else 0
