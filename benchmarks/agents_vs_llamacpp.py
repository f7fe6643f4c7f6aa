"""kvserve next to llama.cpp's llama-server on an agent workload (tool loops), same GGUF.

    python benchmarks/agents_vs_llamacpp.py [--agents 8] [--turns 6] [--out DIR]

The workload is `kvserve bench serve --workload agent`, the same seed for both servers, so
both get the same requests: N agents, each a conversation that sends the same ~2,000 tokens of
function tools on every turn (the prefix all agents share) and grows by a scripted tool call
and its ~150-token result per turn; ``max_tokens`` is small, so a turn is mostly prefill.

Both servers are up together (an idle one takes no CPU) and the run is interleaved by turn: the
N agents send turn k together to one server, all answers come back, then the same turn to the
other (the order alternating turn by turn), so that load from other work on a shared machine
falls on both alike. ``--sequential`` instead runs the whole workload on llama-server, then on
kvserve (one server up at a time; the agents then run freely, each sending its next turn as
soon as its answer is in), through the ``kvserve bench serve`` command line.

Prints per turn index the prompt and prefix-cached tokens each server reported, TTFT p50 on
each and the ratio kvserve / llama-server, then the overall TTFT p50 ratio (the target: <= 0.5
at 8 agents); writes both runs' JSON, results.json and summary.md to --out (default
docs/perf/<date>_<isa>_agents-vs-llamacpp).

The servers:

* llama-server (built by benchmarks/vs_llamacpp.sh) with its Jinja templates and its own tool
  calling, one slot per agent (``-np``), ``-c`` = slots x 8,192 (each slot the model's context,
  kvserve's max_model_len), its default prompt caching (each slot keeps its last prompt, the
  request goes to the slot sharing most of its prefix; the host-memory prompt cache at its
  default size; no ``--cache-reuse``), f16 KV cache (its default). The embedded SmolLM2's chat
  template does not render tools, and llama-server then leaves them out of the prompt (a
  request with 2,000 tokens of tools is 26 prompt tokens), so it gets
  ``--chat-template-file benchmarks/chatml_tools.jinja``: the model's ChatML with the tool prompt
  kvserve's default writes (tests/loadgen/test_bench.py checks that the two render the same
  text); the script checks that both servers report the same prompt tokens each turn.
* kvserve serve with ``--max-num-seqs`` = agents, ``--kv-cache-dtype float16``, tool_choice
  auto allowed (its default), prefix caching on (its default).

TTFT: kvserve opens its stream before computing the prompt, so its TTFT is taken at the first
chunk carrying a token (the requests ask for logprobs, which come with every token while a
tool call's text is held back until the call is whole); llama-server refuses logprobs with
tools in a stream, and sends its first chunk with the first token, so its TTFT is taken there
(``--ttft-at first-chunk``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import serving_process, side_by_side  # noqa: E402
from benchmarks.startup_time import free_port, isa  # noqa: E402
from loadgen.client import BenchClient, ClientConfig  # noqa: E402
from loadgen.serve import machine_info, run_point  # noqa: E402
from loadgen.stats import summarize  # noqa: E402
from loadgen.workloads import (  # noqa: E402
    RequestSpec,
    Session,
    WorkloadConfig,
    build_sessions,
    derive_seed,
    load_tokenizer,
)
from server.cli import main as kvserve  # noqa: E402

TEMPLATE = ROOT / "benchmarks" / "chatml_tools.jinja"
SLOT_CONTEXT = 8192  # the embedded model's context: kvserve's max_model_len


def _bench(url: str, name: str, args: argparse.Namespace, out: Path, *extra: str) -> dict:
    argv = ["bench", "serve", "--base-url", url, "--workload", "agent",
            "--num-requests", str(args.agents * args.turns), "--num-turns", str(args.turns),
            "--concurrency", str(args.agents), "--input-len", str(args.task_len),
            "--output-len", str(args.max_tokens), "--tools-len", str(args.tools_len),
            "--tool-result-len", str(args.tool_result_len), "--seed", str(args.seed),
            "--no-yardstick", "--label", name, "--json", str(out / f"{name}.json"), *extra]
    print(f"\n$ kvserve {' '.join(argv)}", flush=True)
    load = os.getloadavg()
    rc = kvserve(argv)
    result = json.loads((out / f"{name}.json").read_text())
    result["load_avg_before_after"] = [load[0], os.getloadavg()[0]]
    if rc != 0:
        print(f"{name}: some requests failed (exit status {rc})", file=sys.stderr)
    return result


def _workload(args: argparse.Namespace) -> WorkloadConfig:
    """What `kvserve bench serve` sends with the same arguments (its first point's seed)."""
    return WorkloadConfig("agent", num_requests=args.agents * args.turns, num_turns=args.turns,
                          input_len=args.task_len, output_len=args.max_tokens,
                          tools_len=args.tools_len, tool_result_len=args.tool_result_len,
                          seed=derive_seed(args.seed, "point", 0))


def _turn(s: Session, k: int) -> Session:
    """Turn ``k`` of an agent as a conversation of one request: its whole history so far."""
    history = [m for t in s.turns[:k + 1] for m in t.messages or ()]
    return Session(s.index, [RequestSpec(s.turns[k].prompt, s.turns[k].max_tokens,
                                         messages=history)], chat=True, tools=s.tools,
                   tool_choice=s.tool_choice, tools_tokens=s.tools_tokens)


async def _interleaved(urls: dict[str, str], args: argparse.Namespace, out: Path) -> dict:
    cfg = _workload(args)
    sessions = build_sessions(cfg, load_tokenizer(None))
    records: dict[str, list] = {n: [] for n in urls}
    busy = dict.fromkeys(urls, 0.0)
    load = {n: [] for n in urls}
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for name, url in urls.items():
            async with httpx.AsyncClient() as c:
                model = (await c.get(f"{url}/v1/models")).json()["data"][0]["id"]
            clients[name] = await stack.enter_async_context(BenchClient(ClientConfig(
                url, model, ttft_first_chunk=name == "llama-server")))
            warm = build_sessions(WorkloadConfig(num_requests=1, input_len=16, output_len=4,
                                                 seed=derive_seed(args.seed, "warmup")), None)
            await run_point(clients[name], warm, [0.0], None)
        bar = tqdm(total=len(urls) * cfg.num_requests, desc="agent turns", unit="req")
        for k in range(args.turns):
            order = list(urls) if k % 2 == 0 else list(urls)[::-1]
            for name in order:
                bar.set_postfix_str(f"turn {k} on {name}")
                batch = [_turn(s, k) for s in sessions if len(s.turns) > k]
                load[name].append(os.getloadavg()[0])
                recs, dur = await run_point(clients[name], batch, [0.0] * len(batch),
                                            args.agents, bar)
                for r in recs:
                    r.turn = k
                records[name].extend(recs)
                busy[name] += dur
        bar.close()
    params = {"workload": "agent", "mode": "interleaved by turn", "agents": args.agents,
              "num_turns": args.turns, "input_len": cfg.input_len, "output_len":
              cfg.output_len, "tools_len": cfg.tools_len, "tool_result_len":
              cfg.tool_result_len, "tool_choice": cfg.tool_choice, "seed": cfg.seed}
    results = {}
    for name in urls:
        summary = summarize(records[name], busy[name], name, params)
        results[name] = {"tool": "benchmarks/agents_vs_llamacpp.py", "machine": machine_info(),
                         "label": name, "ttft_at": "first-chunk" if name == "llama-server"
                         else "token", "load_avg_per_turn": load[name],
                         "runs": [summary.to_dict()]}
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
        print(f"{name}: {summary.completed} turns answered, {summary.failed} failed; TTFT p50 "
              f"per turn (ms): {[round(t) for t in summary.turn_ttft_p50()]}")
    return results


def _table(results: dict, agents: int) -> tuple[list[str], dict]:
    kv, ll = (results[n]["runs"][0] for n in ("kvserve", "llama-server"))
    lines = ["| turn | prompt tokens (kvserve / llama-server) | cached tokens (kvserve / "
             "llama-server) | TTFT p50 llama-server (ms) | TTFT p50 kvserve (ms) | "
             "kvserve / llama-server |", "|---:|---:|---:|---:|---:|---:|"]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for a, b in zip(kv["per_turn"] or [], ll["per_turn"] or [], strict=True):
        ta, tb = a["ttft_ms"]["p50"], b["ttft_ms"]["p50"]
        lines.append(f"| {a['turn']} | {num(a['prompt_tokens_mean'])} / "
                     f"{num(b['prompt_tokens_mean'])} | {num(a['cached_tokens_mean'])} / "
                     f"{num(b['cached_tokens_mean'])} | {tb:.0f} | {ta:.0f} | {ta / tb:.2f} |")
    ratio = kv["ttft_ms"]["p50"] / ll["ttft_ms"]["p50"]
    lines.append(f"| all | {kv['prompt_tokens']} / {ll['prompt_tokens']} (sum) | "
                 f"{kv['cached_tokens']} / {ll['cached_tokens']} (sum) | "
                 f"{ll['ttft_ms']['p50']:.0f} | {kv['ttft_ms']['p50']:.0f} | {ratio:.2f} |")
    same = all(a["prompt_tokens_mean"] == b["prompt_tokens_mean"]
               for a, b in zip(kv["per_turn"] or [], ll["per_turn"] or [], strict=True))
    figures = {"agents": agents, "ttft_p50_ratio": ratio, "target_ratio": 0.5,
               "target_met": ratio <= 0.5, "same_prompt_tokens_every_turn": same,
               "failed": {"kvserve": kv["failed"], "llama-server": ll["failed"]},
               "turn_ttft_p50_ms": {"kvserve": [t["ttft_ms"]["p50"] for t in kv["per_turn"]],
                                    "llama-server": [t["ttft_ms"]["p50"]
                                                     for t in ll["per_turn"]]}}
    return lines, figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=8, help="concurrent agents (default 8)")
    ap.add_argument("--turns", type=int, default=6, help="turns per agent (default 6)")
    ap.add_argument("--tools-len", type=int, default=2000)
    ap.add_argument("--tool-result-len", type=int, default=150)
    ap.add_argument("--task-len", type=int, default=64, help="tokens of each agent's task")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. --no-repack")
    ap.add_argument("--kvserve-args", default="", help="extra kvserve serve flags")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sequential", action="store_true",
                    help="one server after the other, agents running freely (see above)")
    args = ap.parse_args(argv)
    setup = side_by_side(args.llama_server, args.out, "agents-vs-llamacpp")
    if setup is None:
        return 2
    binary, gguf, threads, out = setup
    print(f"agent workload: {args.agents} agents x {args.turns} turns, ~{args.tools_len} tokens "
          f"of tools, {args.tool_result_len}-token tool results, max_tokens {args.max_tokens}; "
          f"{isa()}, {threads} threads; {gguf}")
    llama_cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "-c",
                 str(SLOT_CONTEXT * args.agents), "-np", str(args.agents), "-t", threads,
                 "--jinja", "--chat-template-file", str(TEMPLATE), *args.llama_args.split()]
    kv_cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1",
              "--max-num-seqs", str(args.agents), "--kv-cache-dtype", "float16",
              *args.kvserve_args.split()]
    results: dict = {"isa": isa(), "date": time.strftime("%Y-%m-%d"), "threads": threads,
                     "args": {k: str(v) for k, v in vars(args).items()},
                     "commands": {"llama-server": llama_cmd, "kvserve": kv_cmd}}
    results["mode"] = "sequential" if args.sequential else "interleaved by turn"
    lport, kport = free_port(), free_port()
    llama = serving_process(llama_cmd + ["--port", str(lport)], lport, out / "llama-server.log")
    kv = serving_process(kv_cmd + ["--port", str(kport)], kport, out / "kvserve.log")
    if args.sequential:
        with llama as url:
            results["llama-server"] = _bench(url, "llama-server", args, out, "--ttft-at",
                                             "first-chunk")
        with kv as url:
            results["kvserve"] = _bench(url, "kvserve", args, out)
    else:
        with llama as lurl, kv as kurl:
            results |= asyncio.run(_interleaved({"llama-server": lurl, "kvserve": kurl}, args,
                                                out))
    lines, figures = _table(results, args.agents)
    results["figures"] = figures
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    title = (f"Agent workload ({results['mode']}), {args.agents} concurrent agents x "
             f"{args.turns} turns "
             f"(~{args.tools_len}-token tools, {args.tool_result_len}-token tool results, "
             f"max_tokens {args.max_tokens}), {isa()}, {threads} threads, "
             f"{time.strftime('%Y-%m-%d')}")
    verdict = (f"TTFT p50 kvserve / llama-server: {figures['ttft_p50_ratio']:.2f} (target <= "
               f"0.5: {'met' if figures['target_met'] else 'NOT met'}); same prompt tokens "
               f"every turn: {figures['same_prompt_tokens_every_turn']}")
    text = "\n".join([title, "", *lines, "", verdict])
    print("\n" + text)
    (out / "summary.md").write_text(f"# {text}\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
