"""Hostile constraints against a real server while a plain user is served: the plain user's
latency alone and during the soak (same run, same server), the server's memory, and what every
hostile request was answered.

    python benchmarks/hostile_grammars.py                       # starts `kvserve serve` itself
    python benchmarks/hostile_grammars.py --url http://127.0.0.1:8000 --pid PID

The soak sends, from ``--clients`` threads at once for ``--seconds`` seconds (each at most one
request every half second, honouring ``Retry-After``: this measures constraints, not an HTTP
flood, which benchmarks/hostile_clients.py and the connection limits cover), the constraints of
issue 64 and their neighbours (recursive ``$ref``s, cycles, ``false``, empty languages, nested
and long bounded quantifiers in regexes and EBNF, a 5,000-member enum, a pattern xgrammar takes
minutes to expand, bodies nested hundreds of levels), each with a fresh variant number so that
the refusal memory does not answer them all at once. The plain user sends the same 16-token
completion (temperature 0) one after another: ``--plain`` of them before the soak (its baseline)
and as many as it can during it. Prints the plain user's latency p50/p90 alone and during the
soak and their ratio, how long a new plain JSON schema from another client address waits for
its answer alone and during the soak, the server's RSS before, at its highest and after (the
process and its children: the grammar vetting process included), and per kind of constraint
the status codes and the slowest answer. A server that holds its ground answers every hostile
request with a 400 (a 200 where the constraint is merely unusual, a 503 with ``Retry-After``
when a client has too many waiting) and no other 5xx, keeps the plain user within 2x of its
baseline and its memory flat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.structured_cost import cpu_isa  # noqa: E402
from loadgen.serve import free_port  # noqa: E402


def _recursive(i: int) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": f"#/$defs/a{i}", "$defs": {f"a{i}": {"type": "object", "properties": {
            "x": {"$ref": f"#/$defs/a{i}"}}, "required": ["x"]}}}}}}


def _schema(schema: object) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def _dead_branch(i: int) -> dict:
    defs = _recursive(i)["response_format"]["json_schema"]["schema"]["$defs"]
    return _schema({"anyOf": [{"type": "string", "maxLength": i + 1},
                              {"$ref": f"#/$defs/a{i}"}], "$defs": defs})


def _nested_objects(levels: int) -> str:
    """A body whose schema nests ``levels`` objects (as text: json.dumps would recurse)."""
    schema = ('{"type":"object","properties":{"a":' * levels + '{"type":"string"}'
              + "}}" * levels)
    return ('{"prompt":"x","max_tokens":8,"response_format":{"type":"json_schema",'
            '"json_schema":{"name":"x","schema":' + schema + "}}}")


HOSTILE: dict[str, Callable[[int], dict | str]] = {
    "recursive required $ref": _recursive,
    "$ref to itself": lambda i: _schema({"$ref": "#", "description": str(i)}),
    "$ref cycle a->b->a": lambda i: _schema({"$ref": "#/$defs/a", "description": str(i), "$defs": {
        "a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}),
    "false schema": lambda i: _schema(False),
    "dead anyOf branch": _dead_branch,
    "empty regex [^\\s\\S]": lambda i: {"structured_outputs": {"regex": f"[^\\s\\S]{{{i + 1}}}"}},
    "regex (\\w+\\s?){1,500}x": lambda i: {"structured_outputs": {
        "regex": f"(\\w+\\s?){{1,{500 + i}}}x"}},
    "nested quantifiers ((a+)+)+b": lambda i: {"structured_outputs": {
        "regex": f"((a+)+)+b{{{i + 1}}}"}},
    "EBNF (w \" \"?){1,500} \"x\"": lambda i: {"structured_outputs": {
        "grammar": f'root ::= (w " "?){{1,{500 + i}}} "x"\nw ::= [a-zA-Z0-9_]+'}},
    "EBNF that only recurses": lambda i: {"structured_outputs": {
        "grammar": f'root ::= "a{i}" root'}},
    "5,000-member enum": lambda i: _schema({"enum": [f"v{i}-{k}" for k in range(5000)]}),
    "pattern a{20000} (slow to expand)": lambda i: _schema({"type": "string",
                                                           "pattern": f"a{{{20000 + i}}}"}),
    "500 nested arrays": lambda i: (
        '{"prompt":"x","max_tokens":8,"response_format":{"type":"json_schema","json_schema":'
        '{"name":"x","schema":{"type":"object","properties":{"a":{"const":%s}}}}}}'
        % ("[" * (500 + i) + "]" * (500 + i))),
    "400 nested objects": lambda i: _nested_objects(400 + i),
    "minItems 100,000": lambda i: _schema({"type": "array", "items": {"type": "integer"},
                                           "minItems": 100000 + i}),
}


PACE_S = 0.5  # a hostile client sends at most one request this often (and honours Retry-After)


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its children, in KiB."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                pass
    return out


def plain_request(client: httpx.Client, model: str) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                             "max_tokens": 16, "temperature": 0,
                                             "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t0


def legit_constraint(client: httpx.Client, model: str, i: int) -> float:
    """A new (uncached) tool-like schema from another client: the time to its answer."""
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 12},
                                               "count": {"type": "integer", "minimum": 0}},
              "required": [f"field_{i}", "count"]}
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={
        "model": model, "prompt": "JSON:", "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                   "schema": schema}}})
    r.raise_for_status()
    return time.perf_counter() - t0


def _post_once_more(c: httpx.Client, body: str) -> httpx.Response:
    """POST, again once if the server closed the idle kept-alive connection just as it was
    reused (a race of keep-alive, not an answer)."""
    for attempt in (0, 1):
        try:
            return c.post("/v1/completions", content=body,
                          headers={"Content-Type": "application/json"})
        except httpx.RemoteProtocolError:
            if attempt:
                raise
    raise AssertionError("unreachable")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else one is started)")
    ap.add_argument("--pid", type=int, help="its process id, for RSS (with --url)")
    ap.add_argument("--seconds", type=float, default=120.0, help="soak duration")
    ap.add_argument("--clients", type=int, default=4, help="hostile clients at once")
    ap.add_argument("--plain", type=int, default=12, help="plain requests for the baseline")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    proc = None
    if args.url is None:
        port = free_port()
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"hostile-grammars-{port}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port",
                                 str(port), "--max-model-len", "2048"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
        args.url, args.pid = f"http://127.0.0.1:{port}", proc.pid
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"{args.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"server did not start; see {log.name}")
                return 1
            time.sleep(1)
    try:
        return run(args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def run(args: argparse.Namespace) -> int:
    client = httpx.Client(base_url=args.url, timeout=600)
    model = client.get("/v1/models").json()["data"][0]["id"]
    for _ in range(3):
        plain_request(client, model)  # warm
    baseline = [plain_request(client, model) for _ in range(args.plain)]
    # another client address: the compile queue serves clients in turn
    other = httpx.Client(base_url=args.url, timeout=600,
                         transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    legit_alone = [legit_constraint(other, model, i) for i in range(4)]
    rss_before = rss_kib(args.pid) if args.pid else 0
    stop = threading.Event()
    rss_peak = [rss_before]
    answers: dict[str, Counter] = defaultdict(Counter)
    errors: Counter = Counter()  # client-side failures (no answer), by exception
    slowest: dict[str, float] = defaultdict(float)
    lock = threading.Lock()
    counter = iter(range(10**9))

    def watch_rss() -> None:
        while not stop.is_set():
            if args.pid:
                rss_peak[0] = max(rss_peak[0], rss_kib(args.pid))
            time.sleep(0.5)

    def hostile(k: int) -> None:
        names = list(HOSTILE)
        with httpx.Client(base_url=args.url, timeout=600) as c:
            j = k * len(names) // args.clients  # each client starts elsewhere in the list
            while not stop.is_set():
                name = names[j % len(names)]
                j += 1
                with lock:
                    i = next(counter)
                body = HOSTILE[name](i)
                if isinstance(body, dict):
                    body = json.dumps({"model": model, "prompt": "Answer:", "max_tokens": 8,
                                       **body})
                t0 = time.perf_counter()
                wait = PACE_S
                try:
                    r = _post_once_more(c, body)
                    status = r.status_code
                    if status == 503:
                        wait = max(wait, float(r.headers.get("Retry-After", 1)))
                except httpx.HTTPError as exc:
                    status = -1
                    with lock:
                        errors[type(exc).__name__] += 1
                took = time.perf_counter() - t0
                with lock:
                    answers[name][status] += 1
                    slowest[name] = max(slowest[name], took)
                stop.wait(max(0.0, wait - took))  # a constraint soak, not an HTTP flood

    legit_during: list[float] = []

    def legit() -> None:
        i = 100
        while not stop.is_set():
            legit_during.append(legit_constraint(other, model, i))
            i += 1
            stop.wait(5.0)

    threads = [threading.Thread(target=watch_rss, daemon=True),
               threading.Thread(target=legit, daemon=True)]
    threads += [threading.Thread(target=hostile, args=(k,), daemon=True)
                for k in range(args.clients)]
    for t in threads:
        t.start()
    during: list[float] = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        during.append(plain_request(client, model))
    stop.set()
    for t in threads:
        t.join(700)
    time.sleep(2)
    rss_after = rss_kib(args.pid) if args.pid else 0
    b50, d50, d90 = statistics.median(baseline), statistics.median(during), pct(during, 0.9)
    five = sum(n for c in answers.values() for s, n in c.items()
               if (s >= 500 and s != 503) or s < 0)
    full = sum(c.get(503, 0) for c in answers.values())
    print(f"CPU: {cpu_isa()}; {args.clients} hostile clients for {args.seconds:.0f} s")
    print(f"plain user, 16 tokens: alone p50 {b50:.3f} s p90 {pct(baseline, 0.9):.3f} s "
          f"({len(baseline)}); during the soak p50 {d50:.3f} s p90 {d90:.3f} s "
          f"({len(during)}): p50 ratio {d50 / b50:.2f}x, p90 ratio "
          f"{d90 / pct(baseline, 0.9):.2f}x")
    if args.pid:
        print(f"server RSS (with children): before {rss_before / 1024:.0f} MiB, highest "
              f"{rss_peak[0] / 1024:.0f} MiB, after {rss_after / 1024:.0f} MiB")
    print(f"a new JSON schema from another client: alone p50 "
          f"{statistics.median(legit_alone):.2f} s, during the soak p50 "
          f"{statistics.median(legit_during):.2f} s, slowest {max(legit_during):.2f} s "
          f"({len(legit_during)})")
    print(f"hostile requests: {sum(sum(c.values()) for c in answers.values())}; 503 (queue "
          f"bound): {full}; other 5xx or no answer: {five} {dict(errors) or ''}")
    for name in HOSTILE:
        codes = ", ".join(f"{s} x{n}" for s, n in sorted(answers[name].items()))
        print(f"  {name:36s} {codes:24s} slowest {slowest[name]:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "baseline": baseline, "during": during, "legit_alone": legit_alone,
            "legit_during": legit_during, "rss_kib": [rss_before, rss_peak[0],
                                                                rss_after],
            "answers": {k: dict(v) for k, v in answers.items()},
            "slowest": dict(slowest), "isa": cpu_isa()}, indent=1))
    return 0 if five == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
