"""Embeddings throughput: kvserve's /v1/embeddings side by side with llama-server
``--embeddings`` on the same GGUF (the embedded SmolLM2-135M), in one run.

    python benchmarks/embeddings.py [--requests 64] [--concurrency 16] [--llama-server PATH]
        [--server-args --cpu-probe off]

Workload (docs/performance.md, "Embeddings"): ``--concurrency`` clients each sending one
input per request, ``--requests`` inputs of ``--tokens`` token ids (sent as ids, so both
servers see the same tokens), in two shapes: **shared**, every input starting with the same
``--prefix`` (64) token instruction, and **unique**, each input's first 64 tokens its own.
kvserve runs with ``--task embed`` (last-token pooling, which shares the prefix cache) and 16
sequences; llama-server with ``--embeddings --pooling last`` and 16 slots. Prints inputs/s,
tokens/s, the prefix-cache share kvserve reports (``usage.prompt_tokens_details``) and, when a
llama-server binary is found (``bash benchmarks/vs_llamacpp.sh`` builds one), the ratio and
the lowest cosine between the two servers' vectors for four inputs (both did the same work).
llama-server that dies at start-up is started again with ``--no-repack`` (as vs_llamacpp.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import find_llama_server, running_server, serving_process  # noqa: E402
from benchmarks.startup_time import isa  # noqa: E402
from loadgen.serve import free_port  # noqa: E402


def workload(n: int, tokens: int, prefix: int, shared: bool, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(100, 40000) for _ in range(prefix)]
    out = []
    for _ in range(n):
        head = common if shared else [rng.randrange(100, 40000) for _ in range(prefix)]
        out.append(head + [rng.randrange(100, 40000) for _ in range(tokens - prefix)])
    return out


def run(url: str, inputs: list[list[int]], concurrency: int) -> dict:
    """Every input as its own request, ``concurrency`` in flight, after a warm-up round of
    the first ``concurrency`` inputs (not measured); wall time and usage."""
    client = httpx.Client(base_url=url, timeout=600)

    def one(ids: list[int]) -> dict:
        r = client.post("/v1/embeddings", json={"input": [ids]})
        r.raise_for_status()
        body = r.json()
        assert len(body["data"][0]["embedding"]) > 0
        return body.get("usage") or {}

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, inputs[:concurrency]))  # warm-up (also fills the cache once)
        inputs = inputs[concurrency:]
        start = time.perf_counter()
        usages = list(pool.map(one, inputs))
        wall = time.perf_counter() - start
    tokens = sum(len(x) for x in inputs)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                 for u in usages)
    return {"inputs_per_s": len(inputs) / wall, "tokens_per_s": tokens / wall, "wall_s": wall,
            "cached_share": cached / tokens}


def vectors(url: str, inputs: list[list[int]]) -> list[list[float]]:
    """Each input's embedding, one request at a time."""
    return [httpx.post(f"{url}/v1/embeddings", json={"input": [ids]}, timeout=600
                       ).json()["data"][0]["embedding"] for ids in inputs]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                    help="extra kvserve serve flags (last on the line), e.g. --cpu-probe off")
    args = ap.parse_args(argv)
    from engine.loading.embedded import embedded_gguf_path

    gguf = str(embedded_gguf_path())
    threads = str(os.cpu_count() or 1)
    shapes = {name: workload(args.requests + args.concurrency, args.tokens, args.prefix,
                             name == "shared", seed=i)
              for i, name in enumerate(("shared", "unique"))}
    results: dict[str, dict[str, dict]] = {}
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    print(f"ISA {isa()}, {threads} threads; {args.requests} inputs of {args.tokens} tokens "
          f"({args.prefix}-token instruction), concurrency {args.concurrency}", flush=True)
    with running_server(["--task", "embed", "--max-num-seqs", str(args.concurrency),
                         "--max-model-len", str(max(512, args.tokens + 16)),
                         *args.server_args],
                        log_dir / "kvserve-embeddings.log") as url:
        results["kvserve"] = {n: run(url, x, args.concurrency) for n, x in shapes.items()}
        same = {"kvserve": vectors(url, shapes["unique"][:4])}
    binary = args.llama_server or find_llama_server()
    llama_cmd: list[str] | None = None
    if binary is not None and binary.exists():
        port = free_port()
        cmd = [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
               "--embeddings", "--pooling", "last", "-np", str(args.concurrency),
               "-c", str(args.concurrency * max(512, args.tokens + 16)), "-t", threads,
               "-ub", str(max(512, args.tokens)), "-b", "2048"]
        def measure_llama() -> None:
            with serving_process(cmd, port, log_dir / "llama-server-embeddings.log") as url:
                results["llama-server"] = {n: run(url, x, args.concurrency)
                                           for n, x in shapes.items()}
                same["llama-server"] = vectors(url, shapes["unique"][:4])

        try:
            measure_llama()
        except RuntimeError as exc:  # died at start-up, before serving
            # As in vs_llamacpp.sh: on AMX (Sapphire Rapids) VMs llama-server dies at "threadpool
            # init" in its AMX weight-repacking path; without repacking it serves (AVX-512 VNNI).
            print(f"llama-server died at start-up ({exc}); retrying with --no-repack",
                  file=sys.stderr)
            cmd += ["--no-repack"]
            measure_llama()
        llama_cmd = cmd
    else:
        print("llama-server not found (bash benchmarks/vs_llamacpp.sh builds one, or pass "
              "--llama-server PATH): kvserve only", file=sys.stderr)
    print("\n| server | inputs | inputs/s | tokens/s | cached share |")
    print("|---|---|---|---|---|")
    for server, shapes_run in results.items():
        for name, r in shapes_run.items():
            print(f"| {server} | {name} | {r['inputs_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{r['cached_share']:.0%} |")
    if "llama-server" in results:
        agree = min(cosine(a, b) for a, b in zip(same["kvserve"], same["llama-server"]))
        results["same_work_min_cosine"] = agree
        print(f"the same vectors (4 inputs, both servers): lowest cosine {agree:.5f}")
        for name in shapes:
            ratio = (results["kvserve"][name]["tokens_per_s"]
                     / results["llama-server"][name]["tokens_per_s"])
            print(f"kvserve / llama-server, {name}: {ratio:.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"isa": isa(), "args": vars(args) | {
            "llama_server": str(binary) if binary else None, "out": str(args.out)},
            "llama_server_cmd": llama_cmd,
            "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
