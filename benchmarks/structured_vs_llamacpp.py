"""Structured output side by side with llama.cpp's llama-server: the same GGUF (the embedded
SmolLM2-135M-Instruct Q4_1), the same JSON schema sent the same way (OpenAI ``response_format``
``json_schema`` on ``/v1/chat/completions``, which both servers constrain with their own grammar
engine: xgrammar in kvserve, llama.cpp's GBNF sampler in llama-server), at concurrency 1 and 16.

    python benchmarks/structured_vs_llamacpp.py [--requests 16] [--max-tokens 400] [--rounds 3]
        [--out DIR]

llama-server must be built first (``bash benchmarks/vs_llamacpp.sh`` builds it once into
``${KVSERVE_LLAMACPP_DIR:-~/.cache/kvserve/llamacpp}``; ``--llama-server PATH`` names another).
Both servers are started once and measured in turn, never both at once: ``--rounds`` rounds
(3), each running llama-server then kvserve at concurrency 1, then both at 16, so a drift of
the machine's speed during the run reaches both; the figures are each side's median round.
Each server has 16 slots / sequences, all cores and a 16-bit KV cache (llama-server's default
f16, kvserve's ``--kv-cache-dtype float16``). Greedy decoding on both; every answer is parsed and validated with ``jsonschema``.
Prints, per server and concurrency, output tokens per second of wall time (completion tokens as
each server's ``usage`` reports them), valid answers per second (llama-server's grammar lets the
model indent its JSON, which costs it tokens per answer, so tokens per second alone flatters it),
request latency p50, the valid fraction, and kvserve's ratios to llama-server; writes the figures
as JSON to ``--out``. ``--max-tokens`` must leave room for an indented answer (about 250 tokens
for this schema), or llama-server's answers are cut short and count as invalid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import jsonschema
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import serving_process, side_by_side  # noqa: E402
from benchmarks.startup_time import free_port, isa  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 16},
                       "role": {"enum": ["engineer", "doctor", "teacher", "artist"]}},
        "required": ["name", "age", "city", "role"]}}},
    "required": ["people"],
}
TOPICS = ["a hospital", "a school", "a startup", "a village", "an orchestra", "a ship",
          "a newspaper", "a bakery"]


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe four people who work at {TOPICS[i % len(TOPICS)]}"
                                        f" (group {i}) as JSON."}]


def _body(model: str, i: int, max_tokens: int) -> dict:
    return {"model": model, "messages": _messages(i), "max_tokens": max_tokens,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "people", "strict": True, "schema": SCHEMA}}}


async def _run(url: str, n: int, concurrency: int, max_tokens: int, label: str) -> dict:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = valid = stopped = 0
    bar = tqdm(total=n, desc=label, unit="req", leave=False)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens, valid, stopped
        async with sem:
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions",
                                  json=_body(model, i, max_tokens))
            latencies.append(time.perf_counter() - t0)
        r.raise_for_status()
        data = r.json()
        tokens += data["usage"]["completion_tokens"]
        choice = data["choices"][0]
        stopped += choice["finish_reason"] == "stop"
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
        bar.update()

    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await one(client, n)  # warm-up (its grammar compiled and cached), not counted
        latencies.clear()
        tokens = valid = stopped = 0
        bar.reset()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(n)))
        wall = time.perf_counter() - t0
    bar.close()
    return {"requests": n, "concurrency": concurrency, "wall_s": wall,
            "completion_tokens": tokens, "output_tok_s": tokens / wall,
            "valid_answers_s": valid / wall,
            "latency_p50_s": statistics.median(latencies), "valid": valid / n,
            "finished_stop": stopped / n}


def _median_run(runs: list[dict]) -> dict:
    """The round with the median output tokens per second, with every round's figure."""
    ranked = sorted(runs, key=lambda r: r["output_tok_s"])
    return {**ranked[(len(ranked) - 1) // 2],
            "rounds_output_tok_s": [round(r["output_tok_s"], 1) for r in runs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds, each running both servers at each concurrency in turn")
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, e.g. --no-repack")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    setup = side_by_side(args.llama_server, args.out, "structured-vs-llamacpp")
    if setup is None:
        return 2
    binary, gguf, threads, out = setup
    results = {"isa": isa(), "schema": SCHEMA, "requests": args.requests,
               "max_tokens": args.max_tokens, "rounds": args.rounds,
               "date": time.strftime("%Y-%m-%d")}
    lport, kport = free_port(), free_port()
    servers = {
        "llama-server": ([str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(lport),
                          "-c", "32768", "-np", "16", "-t", threads, *args.llama_args.split()],
                         lport),
        "kvserve": ([sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1",
                     "--port", str(kport), "--max-num-seqs", "16", "--kv-cache-dtype",
                     "float16"], kport),
    }
    runs: dict[tuple[str, str], list[dict]] = {}
    # Both servers up at once, idle while the other is measured; each round runs them in
    # turn at each concurrency, so a drift of the machine's speed reaches both alike.
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serving_process(cmd, port, out / f"{name}.log"))
                for name, (cmd, port) in servers.items()}
        for r in range(args.rounds):
            for c in (1, 16):
                for name, url in urls.items():
                    runs.setdefault((name, f"c{c}"), []).append(asyncio.run(_run(
                        url, args.requests, c, args.max_tokens,
                        f"round {r + 1}/{args.rounds} {name} c={c}")))
    for (name, c), rs in runs.items():
        results.setdefault(name, {})[c] = _median_run(rs)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nstructured output (JSON schema, {args.requests} requests, greedy), {isa()}, "
          f"{threads} threads; the median of {args.rounds} interleaved rounds (each round's "
          f"tok/s in brackets)")
    print(f"{'':>4} | {'server':>12} | {'out tok/s':>9} | {'valid/s':>7} | {'p50 s':>6} | "
          f"{'valid':>5} | tok/s ratio | valid/s ratio | rounds")
    for c in ("c1", "c16"):
        base = results["llama-server"][c]
        for name in ("llama-server", "kvserve"):
            r = results[name][c]
            per_s = (f"{r['valid_answers_s'] / base['valid_answers_s']:.2f}x"
                     if base["valid_answers_s"] else "-")
            print(f"{c:>4} | {name:>12} | {r['output_tok_s']:9.1f} | {r['valid_answers_s']:7.3f} | "
                  f"{r['latency_p50_s']:6.2f} | {r['valid']:5.0%} | "
                  f"{r['output_tok_s'] / base['output_tok_s']:10.2f}x | {per_s:>13} | "
                  f"{r['rounds_output_tok_s']}")
    ratios = [k["output_tok_s"] / b["output_tok_s"] for k, b in
              zip(runs[("kvserve", "c1")], runs[("llama-server", "c1")], strict=True)]
    print(f"c=1 tok/s ratio per round: {', '.join(f'{x:.2f}x' for x in ratios)}")
    print(f"written: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
