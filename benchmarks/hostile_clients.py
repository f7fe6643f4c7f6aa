"""Hostile requests against a running server: how fast each is answered, and how long ``/health``
takes to answer while they run.

Usage: ``python benchmarks/hostile_clients.py --url http://127.0.0.1:8000 [--timeout 30]``

Each probe sends one small request that, before issue 11's fixes, could stall or kill the
engine (a 1,000-prompt x n=128 batch, a 2 MiB /tokenize body, a client-supplied chat template, a
lone surrogate), and at the same time polls ``/health`` every 50 ms. It prints, per probe, the
status code, the time to answer (or ``>timeout``), and the slowest ``/health`` answer seen while
the probe was in flight. A server that survives its clients answers every probe with a 4xx in
milliseconds and keeps ``/health`` fast throughout.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx

PROBES: list[tuple[str, str, object]] = [
    ("1,000 prompts x n=128, max_tokens=1", "/v1/completions",
     {"prompt": ["a"] * 1000, "n": 128, "max_tokens": 1}),
    ("2 MiB of text to /tokenize", "/tokenize", {"prompt": "hello world " * 174763}),
    ("client chat template", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
      "chat_template": "{% for i in range(9999) %}{% for j in range(9999) %}x{% endfor %}"
                       "{% endfor %}"}),
    ("lone surrogate in the prompt", "/v1/completions", '{"prompt": "\\ud800", "max_tokens": 1}'),
    ("stop list of 100,000 strings", "/v1/completions",
     {"prompt": "a", "max_tokens": 4, "stop": ["zz"] * 100_000}),
]


def _health_watch(url: str, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                c.get("/health")
            except httpx.HTTPError:
                pass
            worst[0] = max(worst[0], time.perf_counter() - t0)
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait per probe")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    model = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
    results = []
    for name, path, body in PROBES:
        if isinstance(body, dict) and path != "/tokenize":
            body = {"model": model, **body}
        stop, worst = threading.Event(), [0.0]
        watcher = threading.Thread(target=_health_watch, args=(args.url, stop, worst))
        watcher.start()
        t0 = time.perf_counter()
        try:
            content = body if isinstance(body, str) else json.dumps(body)
            r = httpx.post(f"{args.url}{path}", content=content, timeout=args.timeout,
                           headers={"Content-Type": "application/json"})
            status, elapsed = str(r.status_code), time.perf_counter() - t0
        except httpx.TimeoutException:
            status, elapsed = "timeout", None
        finally:
            stop.set()
            watcher.join()
        results.append({"probe": name, "status": status, "seconds": elapsed,
                        "worst_health_seconds": worst[0]})
        took = f">{args.timeout:.0f} s" if elapsed is None else f"{elapsed * 1000:8.1f} ms"
        print(f"{name:40s} {status:>8s} {took:>12s}   /health worst {worst[0] * 1000:8.1f} ms")
    health = httpx.get(f"{args.url}/health", timeout=args.timeout).status_code
    print(f"/health after the probes: {health}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "health_after": health}, f, indent=2)


if __name__ == "__main__":
    main()
