"""What one open KV page (``/kv``) costs a server: W1 with and without it, side by side.

    python benchmarks/kv_page_cost.py [--rounds 2] [--json docs/perf/kv_page_cost.json]

One real ``kvserve serve`` (the embedded model) serves W1 (``kvserve bench serve --workload
random --num-requests 64 --input-len 280 --output-len 64 --concurrency 16``) several times,
alternating "no page" and "one page open" (ABBA order, so that a drift of the machine's load
hits both sides alike; each run a fresh seed, so that no run hits another's prefix cache).
"One page open" is what an open page makes the server do: a client holds ``/kv/events`` at the
page's default interval (0.5 s) and parses every document, as the page's script does (its
drawing runs on the viewer's machine, not the server's). Prints output tok/s of each run and
the ratio page/no-page of their sums (the issue's bar: >= 0.98).

On a loaded machine W1's run-to-run noise exceeds 2%, so the script also measures the page's
work directly, in this process (``--direct``, on by default): the embedded model serves W1's
first 16 requests step by step while, every 0.5 s of step time, a snapshot is taken and turned
into the page's JSON exactly as ``/kv/events`` does (``EngineCore.kv_snapshot`` +
``state_document`` + ``json.dumps``); it prints that work's time as a fraction of the steps'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.serve import free_port, machine_info  # noqa: E402

W1 = ["--workload", "random", "--input-len", "280", "--output-len", "64", "--concurrency", "16"]


class PageClient:
    """Holds ``/kv/events`` open on a thread and parses its documents, like the page."""

    def __init__(self, url: str, interval: float = 0.5) -> None:
        self.url, self.interval = url, interval
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PageClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.stream("GET", f"{self.url}/kv/events?interval={self.interval}",
                          timeout=None) as r:
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data: "):
                    json.loads(line[6:])
                    self.events += 1


def run_w1(url: str, seed: int, num_requests: int = 64) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", url,
                        *W1, "--num-requests", str(num_requests), "--seed", str(seed), "--no-yardstick", "--no-progress",
                        "--json", out.name], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        return json.loads(Path(out.name).read_text())["runs"][0]["output_throughput"]


def direct_cost(interval: float = 0.5) -> dict:
    """The page's server-side work per second of serving, measured in-process (docstring)."""
    import random

    from engine.llm import LLM
    from engine.sampling.params import SamplingParams
    from server.kv_page.state import PrefixText, state_document

    llm = LLM(max_num_seqs=16)
    core = llm.engine
    decode = PrefixText(core.tokenizer)
    rng = random.Random(0)
    for i in range(16):
        core.add_request(f"w1-{i}", [rng.randrange(100, 30000) for _ in range(280)],
                         SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    step_s = page_s = 0.0
    since = 0.0
    snapshots = 0
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        dt = time.perf_counter() - t
        step_s += dt
        since += dt
        if since >= interval:
            since = 0.0
            t = time.perf_counter()
            json.dumps(state_document(core.kv_snapshot(), decode), separators=(",", ":"))
            page_s += time.perf_counter() - t
            snapshots += 1
    blocks = core.kv.num_blocks
    llm.close()
    return {"step_s": step_s, "page_s": page_s, "snapshots": snapshots, "num_blocks": blocks,
            "ms_per_snapshot": 1000 * page_s / max(snapshots, 1),
            "fraction": page_s / step_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2,
                    help="ABBA rounds (default 2: 8 runs; 0: the in-process figure only)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--serve-args", default="", help="extra flags for kvserve serve")
    ap.add_argument("--num-requests", type=int, default=64,
                    help="requests per run (default 64: W1; fewer keeps W1's shape and "
                         "concurrency, for a slow machine)")
    ap.add_argument("--no-direct", action="store_true", help="skip the in-process measurement")
    args = ap.parse_args()
    direct = None
    if not args.no_direct:
        direct = direct_cost()
        print(f"in-process: {direct['snapshots']} page updates over {direct['step_s']:.1f} s of "
              f"W1 steps took {1000 * direct['page_s']:.1f} ms ({direct['ms_per_snapshot']:.2f} "
              f"ms each, {direct['num_blocks']} blocks): {100 * direct['fraction']:.3f}% of "
              f"the steps' time", flush=True)
    if args.rounds == 0:  # the in-process figure only, added to an existing --json file
        if args.json and direct is not None:
            path = Path(args.json)
            doc = json.loads(path.read_text()) if path.exists() else {}
            doc["direct"] = direct | {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            path.write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="kvserve-page-cost-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                             "--disable-log-requests", *args.serve_args.split()], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                            stderr=subprocess.STDOUT)
    runs: list[dict] = []
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        run_w1(url, seed=999, num_requests=4)  # warm-up, not counted
        seed = 1000
        for r in range(args.rounds):
            for page in ((False, True, True, False) if r % 2 == 0 else (True, False, False, True)):
                seed += 1
                if page:
                    with PageClient(url) as client:
                        tps = run_w1(url, seed, args.num_requests)
                    events = client.events
                else:
                    tps, events = run_w1(url, seed, args.num_requests), 0
                runs.append({"page_open": page, "seed": seed, "output_tok_s": tps,
                             "page_events": events})
                print(f"round {r} page={'open' if page else 'none':4} {tps:8.2f} tok/s"
                      f"{f'  ({events} page updates)' if page else ''}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    on = sum(x["output_tok_s"] for x in runs if x["page_open"])
    off = sum(x["output_tok_s"] for x in runs if not x["page_open"])
    ratio = on / off
    print(f"W1 output tok/s, page open / no page: {ratio:.4f} ({(1 - ratio) * 100:+.2f}% cost)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tool": "benchmarks/kv_page_cost.py", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine_info(), "workload": "W1 shape: " + " ".join(W1) + f" --num-requests {args.num_requests}", "runs": runs,
            "ratio_page_over_none": ratio, "direct": direct}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
